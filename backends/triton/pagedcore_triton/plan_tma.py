"""When prefill launches use the Hopper kernel (``kernels/prefill_tma.py``), and its tiles.

Pure Python (no triton import). The metadata builder decides per step from the device and
the KV-cache spec (`tma_prefill_device`, `tma_prefill_spec`); the impl then checks each
layer's features and tensors (`tma_layer_reason`), and a layer the kernel does not serve
runs the gather kernel (``kernels/attention.py``) for that part instead.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from pagedcore_triton.plan import TileConfig

if TYPE_CHECKING:
    import torch

__all__ = [
    "PREFILL_KERNEL_ENV",
    "TMA_DEFAULT_TILES_128",
    "TMA_HEAD_SIZES",
    "TMA_TILES_ENV",
    "packed_tile_config",
    "parse_tma_tiles",
    "tma_layer_reason",
    "tma_prefill_device",
    "tma_prefill_spec",
    "tma_tile_config",
]

#: ``tma`` forces the Hopper prefill kernel for prefill launches (also in the interpreter:
#: tests), ``gather`` forces the gather kernel; unset picks ``tma`` on compute capability 9.x.
PREFILL_KERNEL_ENV = "PAGEDCORE_TRITON_PREFILL_KERNEL"
#: Tuning: the Hopper kernel's tiles, ``"BLOCK_M,TILE_N,WARPS,STAGES[,FLAG...]"`` (see
#: `parse_tma_tiles`).
TMA_TILES_ENV = "PAGEDCORE_TRITON_TMA_TILES"
#: Head sizes the Hopper kernel serves (a ``[TILE_N, D]`` box of 16-bit rows, no padding).
TMA_HEAD_SIZES = (64, 128)
#: Flags of `parse_tma_tiles`: ``ws`` asks Triton to warp-specialize the unmasked loop,
#: ``fwd`` keeps the natural q-block order, ``e1`` leaves the diagonal loop unpipelined,
#: ``dN`` walks the keys next to the causal diagonal in tiles of ``N`` (16, 32 or 64, at
#: most the q-block's tokens) so that only the last one is masked, ``hm`` makes the KV
#: head the grid's fast axis (all heads of the longest q-block first), ``rN`` caps the
#: registers per thread at ``N`` (Triton's ``maxnreg``: 128 on 8 warps fits two programs
#: per SM where the shared memory allows it) in launches without a cached prefix (whose
#: gather would spill under the cap).
#: ``wsk`` runs launches without a cached prefix on the warp-specialized kernel
#: (``prefill_tma_ws_kernel``: one query head per program, one branch-free key loop);
#: with ``wsk``, ``p`` runs its persistent form (`TileConfig.persistent`: one program per
#: SM looping over the q-blocks in the ``hm`` order). It ran as fast as the shipped kernel
#: on an H100, no faster (session 24, ``docs/benchmarks/h100_s24/README.md``, where the
#: other persistent forms measured slower and were removed); it stays for tuning on other
#: cards.
TMA_TILE_FLAGS = ("ws", "fwd", "e1", "d16", "d32", "d64", "hm", "wsk", "p")
#: The default tiles for head size 128 on the GPU when not `packed_tile_config`'s (None):
#: set only from a variant that passed the conformance suite on the H200 and beat the
#: packed default there (``docs/benchmarks/triton.md``, "Session 12": the warp-specialized
#: kernel, 0.795x / 0.895x SDPA at 4x2048 / 4x8192 against the packed kernel's 0.707x /
#: 0.859x; 34 of 50 conformance cases ran in the cap, all passed).
TMA_DEFAULT_TILES_128: str | None = "128,128,4,2,wsk,hm"
#: Register caps `parse_tma_tiles` accepts (``rN``).
TMA_MAXNREG = (64, 80, 96, 112, 128, 168, 255)


def tma_prefill_device(device: torch.device, *, interpreting: bool) -> bool:
    """Whether prefill launches on `device` go to the Hopper kernel: ``PREFILL_KERNEL_ENV``
    when set, else a CUDA device of compute capability 9.x (sm_90; other GPUs and the
    interpreter keep the gather kernel)."""
    choice = os.environ.get(PREFILL_KERNEL_ENV, "")
    if choice not in ("", "tma", "gather"):
        raise ValueError(
            f"{PREFILL_KERNEL_ENV}={choice!r}: expected 'tma' (the Hopper prefill kernel), "
            "'gather' (the paged-gather kernel) or unset (tma on compute capability 9.x)"
        )
    if choice:
        return choice == "tma"
    if interpreting or device.type != "cuda":
        return False
    import torch

    return torch.cuda.get_device_capability(device)[0] == 9


def tma_prefill_spec(head_size: int) -> bool:
    """Whether a KV-cache group of head size `head_size` can use the Hopper kernel."""
    return head_size in TMA_HEAD_SIZES


def tma_layer_reason(
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    *,
    token_end: int,
    plain: bool,
    interpreting: bool,
) -> str | None:
    """None when this layer's launch can run on the Hopper kernel, else why not.

    `plain`: the layer has no ALiBi, sliding window, soft-cap, sinks or fp8 cache (those run
    the gather kernel). `key` / `value` must be ``[>= token_end, Hkv, D]`` in the query's
    dtype with rows 16-byte aligned and ``[Hkv, D]`` contiguous (a TMA box per tile).
    """
    import torch

    if not plain:
        return "the layer uses ALiBi, a sliding window, soft-cap, sinks or an fp8 cache"
    if key is None or value is None:
        return "forward() got no key/value"
    if query.dtype not in (torch.float16, torch.bfloat16) and not interpreting:
        return f"{query.dtype} (the kernel runs 16-bit dtypes)"
    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or t.shape[0] < token_end or t.dtype != query.dtype:
            return f"{name} is not [T, Hkv, D] in the query's dtype"
        if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
            return f"{name}'s [Hkv, D] rows are not contiguous"
        if (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return f"{name}'s rows are not 16-byte aligned"
    return None


def parse_tma_tiles(text: str, num_queries_per_kv: int) -> TileConfig:
    """A Hopper-kernel `TileConfig` from ``"BLOCK_M,TILE_N,WARPS,STAGES[,FLAG...]"``.

    Flags: ``ws`` (warp-specialize the unmasked loop), ``fwd`` (natural q-block order),
    ``e1`` (the diagonal loop not pipelined), ``dN`` (diagonal keys in tiles of ``N``),
    ``hm`` (KV heads on the grid's fast axis), ``rN`` (at most ``N`` registers per thread),
    ``wsk`` (the warp-specialized kernel) and with it ``p`` (its persistent form, see
    `TMA_TILE_FLAGS`).
    """
    fields = [f.strip() for f in text.split(",")]
    try:
        block_m, tile_n, warps, stages = (int(f) for f in fields[:4])
    except ValueError:
        block_m = tile_n = warps = stages = 0
    flags = fields[4:]
    regs = [f for f in flags if f.startswith("r") and f[1:].isdecimal()]
    flags = [f for f in flags if f not in regs]
    maxnreg = int(regs[-1][1:]) if regs else None
    ok = len(fields) >= 4 and all(f in TMA_TILE_FLAGS for f in flags)
    ok = ok and (maxnreg is None or (maxnreg in TMA_MAXNREG and len(regs) == 1))
    # wsk with keys tiles narrower than the query block returned NaN on the H200 (round 3).
    ok = ok and ("wsk" not in flags or tile_n == block_m)
    persistent = "p" in flags
    ok = ok and ("wsk" in flags or not persistent)
    pow2 = all(x >= 16 and x & (x - 1) == 0 for x in (block_m, tile_n))
    block_q = block_m if "wsk" in flags else max(1, block_m // num_queries_per_kv)
    diag = max([int(f[1:]) for f in flags if f.startswith("d")], default=0)
    if diag and (diag > min(block_q, tile_n) or block_q & (block_q - 1)):
        ok = False
    if not ok or not pow2 or min(warps, stages) <= 0 or block_m < num_queries_per_kv:
        raise ValueError(
            f"{TMA_TILES_ENV}={text!r}: expected 'BLOCK_M,TILE_N,WARPS,STAGES[,FLAG...]' with "
            "BLOCK_M and TILE_N powers of two >= 16 (BLOCK_M at least the query heads per KV "
            f"head), positive WARPS and STAGES, flags among {', '.join(TMA_TILE_FLAGS)} (dN: "
            "N at most TILE_N and BLOCK_M / query heads per KV head, a power of two; at most "
            "p only with wsk, whose TILE_N must equal BLOCK_M) and at "
            f"most one rN (N in {', '.join(map(str, TMA_MAXNREG))}); e.g. '128,128,8,3' or "
            "'128,64,8,2,r128'"
        )
    return TileConfig(
        block_m=block_m,
        block_q=block_q,
        tile_n=tile_n,
        num_warps=warps,
        num_stages=stages,
        skip_interior_masks=True,
        longest_first="fwd" not in flags,
        unpipelined_edges="e1" in flags,
        int32_offsets=True,
        warp_specialize="ws" in flags,
        diag_tile_n=diag,
        maxnreg=maxnreg,
        heads_fast="hm" in flags or persistent,
        tma_ws="wsk" in flags,
        persistent=persistent,
    )


def tma_tile_config(
    num_queries_per_kv: int, head_size: int, *, interpreting: bool,
    override: str | None = None, has_context: bool = False,
) -> TileConfig:
    """Tiles of a Hopper-kernel launch: `override` (``TMA_TILES_ENV``) when given, else
    `TMA_DEFAULT_TILES_128` for head size 128 when set, else `packed_tile_config`. A launch
    with a cached prefix (`has_context`) never gets a ``wsk`` configuration: it runs the
    GQA-packed kernel with `packed_tile_config`."""
    text = override or (TMA_DEFAULT_TILES_128 if head_size == 128 and not interpreting
                        else None)
    if text:
        cfg = parse_tma_tiles(text, num_queries_per_kv)
        if not (cfg.tma_ws and has_context):
            return cfg
    return packed_tile_config(num_queries_per_kv, head_size, interpreting=interpreting)


def packed_tile_config(num_queries_per_kv: int, head_size: int, *,
                       interpreting: bool) -> TileConfig:
    """Tiles of the GQA-packed kernel (``prefill_tma_kernel``): in the interpreter 32 rows x
    16 keys; else 128 rows (query tokens x the GQA group) x 128 keys on 8 warps, the
    unmasked loop in 3 stages and the diagonal's masked loop unpipelined (``e1``), 128 x 64
    for head size 64 (not timed). Of the variants timed on the H200
    (``docs/benchmarks/triton.md``, "Hopper prefill kernel") 128 x 128 on 8 warps was the
    fastest at both 4x2048 and 4x8192; ``e1`` gained 1.6% at 4x2048 and lost 0.6% at
    4x8192."""
    rows = 1 << max(0, num_queries_per_kv - 1).bit_length()
    if interpreting:
        return parse_tma_tiles(f"{max(32, rows)},16,4,1", num_queries_per_kv)
    tile_n = 128 if head_size == 128 else 64
    return parse_tma_tiles(f"{max(128, rows)},{tile_n},8,3,e1", num_queries_per_kv)
