"""Cascade attention in the Triton backend: plan (in the builder) and run (in the impl).

A cascade step is two launches per layer: the shared prefix for all queries at once
(`cascade_prefix_kernel`: every request's query rows of a KV head in dense tiles, the prefix
split over the GPU's SMs), then the per-request suffixes (`paged_attention_kernel` over the
block table and ``seq_lens`` shifted past the prefix), which folds the prefix's partial
states into its own before writing the output. When the suffix launch itself splits (long
suffixes, few requests) it leaves partials and `cascade_merge_kernel` merges both sets (three
launches). Shifting keeps the causal mask right (it is aligned to each sequence's end) and
ALiBi would be too (relative positions), but layers with ALiBi or a sliding window run the
plain plan instead: the prefix kernel has neither (declared in the plugin guide). Soft-cap
is applied in both parts.

`plan_cascade` plans from this step's Python-int prefix length (an eager step).
`plan_graph_cascade` is the CUDA-graph form: the prefix length is a ``[1]`` int32 device
scalar, the suffix lengths and the shifted block table are filled by device ops into static
buffers, and the prefix launch is sized for a capacity (the longest prefix the bucket may
hold), reading the real length on the device; its launches can be captured once and
replayed for any prefix up to the capacity (``docs/engine.md``).

``PAGEDCORE_TRITON_CASCADE_PREFIX`` (tuning) overrides the prefix launch's shape:
``BLOCK_M,TILE_N,num_warps,num_stages,programs_per_sm[,rMAXNREG]`` (see `prefix_config`).
``PAGEDCORE_TRITON_CASCADE_OVERLAP=1`` (experiment, CUDA only) runs the prefix launch on a
side stream beside a split suffix launch (the builder then splits a decode step's suffix
launch at least in two), joined before `cascade_merge_kernel`, so that the compute-bound
prefix and the memory-bound suffixes can share the SMs (see `CascadePlan.overlap`). On an
H100 it measured no faster than the fused cascade (0.0653 vs 0.0637 ms from a graph,
``docs/benchmarks/h100_s24/README.md``), so it stays off.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import attrs
import torch
import triton

from pagedcore.attention import CommonAttentionMetadata
from pagedcore_triton._env import interpreting
from pagedcore_triton.launch import PreparedLaunch
from pagedcore_triton.plan import LaunchPart, TileConfig

__all__ = [
    "CASCADE_OVERLAP_ENV",
    "CASCADE_PREFIX_ENV",
    "MAX_SUFFIX_ROWS",
    "CascadePlan",
    "PrefixConfig",
    "fill_graph_cascade",
    "overlap_enabled",
    "plan_cascade",
    "plan_graph_cascade",
    "prefix_config",
    "run_cascade",
    "suffix_tiles",
]

#: Tuning override of the prefix launch (`prefix_config`).
CASCADE_PREFIX_ENV = "PAGEDCORE_TRITON_CASCADE_PREFIX"
#: Experiment switch: the prefix launch on a side stream beside the suffix launch
#: (`overlap_enabled`).
CASCADE_OVERLAP_ENV = "PAGEDCORE_TRITON_CASCADE_OVERLAP"
#: Fewest prefix tiles a split-KV segment of the prefix holds.
MIN_PREFIX_TILES_PER_SEGMENT = 4
#: Largest prefix partials (bytes) a step may hold before the prefix stops splitting.
MAX_PREFIX_PARTIAL_BYTES = 64 << 20
#: Most query rows per KV head (longest query x query heads per KV head) a cascade step's
#: suffix launch may hold: its prefill tiles then fold the prefix partials in with at most
#: 64-row tiles. A mixed step with a 2,048-token chunk of the Llama-3-8B shape (128-row
#: tiles plus the fused merge) made Triton 3.6's ptxas crash on the H200 (SIGSEGV; the
#: PTX needed 255 registers and spilled under CUDA 13's ptxas); such steps run the plain
#: plan, where the chunk's own reads dominate anyway.
MAX_SUFFIX_ROWS = 64
#: The suffix launch of a decode cascade on a GPU (16-bit, head size <= 128): 32-token
#: tiles on 4 stages instead of the decode default (64 on 3): at 64 requests x 256 own
#: tokens x 8 KV heads (512 programs) the smaller tiles let the whole grid be resident
#: at once; the target step took 0.0597 instead of 0.0692 ms on the H200
#: (``docs/benchmarks/h200_s17/cascade_suffix.json``, ``suffix`` part).
SUFFIX_DECODE_TILES = {"tile_n": 32, "num_warps": 4, "num_stages": 4}
#: SMs assumed where the device cannot say (Triton's interpreter).
_DEFAULT_SMS = 4


@attrs.frozen(kw_only=True, eq=False)
class CascadePlan:
    """One cascade step.

    Attributes
    ----------
    prefix_len:
        Shared tokens ``P`` (a multiple of the block size).
    prefix_blocks:
        ``[P // block_size]`` int32 view of the first block-table row.
    suffix_seq_lens:
        ``[B]`` int32: ``seq_lens - P``.
    suffix_table:
        ``[B, max_blocks - P // block_size]`` int32 view of the block table past the prefix.
    suffix_part:
        The suffix launch over all requests and tokens (its split-KV segments planned for
        the suffix lengths; unsplit, it merges the prefix's partials itself).
    num_tokens:
        Real query tokens ``T``.
    scratch:
        The prefix partials of the step's layer shapes (the layers run one after the other),
        filled by `run_cascade`.
    prefix_len_dev:
        ``[1]`` int32 device scalar holding the real ``P`` (`plan_graph_cascade`), else None;
        with it `prefix_len` is the capacity the prefix launch is sized for and
        `prefix_blocks` spans the capacity's blocks.
    overlap:
        Run the prefix launch on a side stream beside the (split) suffix launch
        (``PAGEDCORE_TRITON_CASCADE_OVERLAP``, decided once per step by the builder).
    """

    prefix_len: int
    prefix_blocks: torch.Tensor
    suffix_seq_lens: torch.Tensor
    suffix_table: torch.Tensor
    suffix_part: LaunchPart
    num_tokens: int
    scratch: dict[tuple[Any, ...], Any] = attrs.field(factory=dict, repr=False)
    prefix_len_dev: torch.Tensor | None = None
    overlap: bool = False


@attrs.frozen(kw_only=True)
class PrefixConfig:
    """Shape of one prefix launch: ``(m_tiles, Hkv, segments)`` programs of ``block_m``
    query rows, walking ``tile_n``-token tiles on ``num_warps`` warps and ``num_stages``
    pipeline stages, registers capped at ``maxnreg`` per thread when set."""

    block_m: int
    tile_n: int
    num_warps: int
    num_stages: int
    m_tiles: int
    segments: int
    maxnreg: int | None = None


def plan_cascade(
    common: CommonAttentionMetadata, prefix_len: int, block_size: int, part: LaunchPart,
    *, overlap: bool = False,
) -> CascadePlan:
    """The cascade plan of a step whose requests share `prefix_len` tokens; `part` is the
    builder's one-launch part over the whole step, with the split-KV segments it chose for
    the suffix lengths. `overlap` (`overlap_enabled`) holds only when `part` splits: an
    unsplit suffix launch merges the prefix's partials itself, so it must follow it."""
    num_reqs = common.num_reqs
    n_blocks = prefix_len // block_size
    suffix_part = attrs.evolve(
        part,
        flat_programs=None,
        balanced_programs=None,
        min_segment_tokens=0,
        tma_prefill=False,
    )
    return CascadePlan(
        prefix_len=prefix_len,
        prefix_blocks=common.block_table[0, :n_blocks],
        suffix_seq_lens=common.seq_lens[:num_reqs] - prefix_len,
        suffix_table=common.block_table[:num_reqs, n_blocks:],
        suffix_part=suffix_part,
        num_tokens=common.num_actual_tokens,
        overlap=overlap and suffix_part.num_segments > 1,
    )


def plan_graph_cascade(
    common: CommonAttentionMetadata,
    prefix_len_dev: torch.Tensor,
    capacity: int,
    block_size: int,
    part: LaunchPart,
    *,
    suffix_seq_lens: torch.Tensor,
    suffix_table: torch.Tensor,
    overlap: bool = False,
) -> CascadePlan:
    """The cascade plan of a CUDA-graph step: no host reads, only device ops into static
    buffers (so the same plan, its launches captured, serves every replay of the bucket).

    Parameters
    ----------
    common:
        The bucket's metadata (padding requests as the contract has them: ``seq_lens`` 1 and
        the null block; their suffix is empty once ``P > 0`` and their outputs are discarded).
    prefix_len_dev:
        ``[1]`` int32 on the device: this replay's shared tokens ``P`` (a multiple of
        `block_size`, at most `capacity`; 0 is allowed: the prefix contributes nothing).
    capacity:
        The longest prefix (tokens, a multiple of `block_size`) the graph may replay with;
        it sizes the prefix launch and must fit the block table.
    part:
        The suffix launch part of the bucket (its split-KV segments sized for the bucket's
        longest sequence, as `build_for_cudagraph_capture` plans them).
    suffix_seq_lens:
        ``[B]`` int32 buffer, filled with ``max(seq_lens - P, 0)``.
    suffix_table:
        ``[B, W]`` int32 buffer (``W`` the block table's width), filled with the block
        table shifted left by ``P // block_size`` (its tail repeats the last column; those
        entries lie past every suffix length, never read).
    overlap:
        As in `plan_cascade`.
    """
    num_reqs = common.num_reqs
    table = common.block_table[:num_reqs]
    width = table.shape[1]
    if capacity % block_size or not 0 <= capacity // block_size <= width:
        raise ValueError(f"cascade capacity {capacity} must be a multiple of the block size "
                         f"{block_size} within the block table's {width} blocks")
    if suffix_seq_lens.shape != (num_reqs,) or suffix_table.shape != (num_reqs, width):
        raise ValueError(f"cascade buffers {tuple(suffix_seq_lens.shape)} / "
                         f"{tuple(suffix_table.shape)} must be ({num_reqs},) / "
                         f"({num_reqs}, {width})")
    fill_graph_cascade(common, prefix_len_dev, block_size, suffix_seq_lens, suffix_table)
    suffix_part = attrs.evolve(part, flat_programs=None, balanced_programs=None,
                               min_segment_tokens=0, tma_prefill=False)
    return CascadePlan(
        prefix_len=capacity,
        prefix_blocks=common.block_table[0, : capacity // block_size],
        suffix_seq_lens=suffix_seq_lens,
        suffix_table=suffix_table,
        suffix_part=suffix_part,
        num_tokens=common.num_actual_tokens,
        prefix_len_dev=prefix_len_dev,
        overlap=overlap and suffix_part.num_segments > 1,
    )


def fill_graph_cascade(
    common: CommonAttentionMetadata,
    prefix_len_dev: torch.Tensor,
    block_size: int,
    suffix_seq_lens: torch.Tensor,
    suffix_table: torch.Tensor,
) -> None:
    """Refill a graph plan's suffix buffers for this replay's ``P`` (device ops only: safe
    to run before a replay or inside a capture)."""
    num_reqs = common.num_reqs
    table = common.block_table[:num_reqs]
    width = table.shape[1]
    torch.clamp(common.seq_lens[:num_reqs] - prefix_len_dev, min=0, out=suffix_seq_lens)
    shift = torch.div(prefix_len_dev, block_size, rounding_mode="floor").to(torch.int64)
    cols = torch.clamp(torch.arange(width, device=table.device) + shift, max=width - 1)
    torch.gather(table, 1, cols.expand(num_reqs, width), out=suffix_table)


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_SMS
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def _parse_override(text: str) -> tuple[int, int, int, int, float, int | None]:
    fields = [f.strip() for f in text.split(",")]
    maxnreg = None
    if len(fields) == 6 and fields[5][:1] == "r" and fields[5][1:].isdecimal():
        maxnreg = int(fields[5][1:])
        fields = fields[:5]
    try:
        block_m, tile_n, warps, stages = (int(x) for x in fields[:4])
        per_sm = float(fields[4]) if len(fields) == 5 else 1.0
        if len(fields) > 5:
            raise ValueError
    except ValueError:
        raise ValueError(
            f"{CASCADE_PREFIX_ENV}={text!r}: expected BLOCK_M,TILE_N,num_warps,num_stages"
            "[,programs_per_sm[,rMAXNREG]] (integers; e.g. 128,64,8,3,1 or 64,32,4,3,3,r168); "
            "unset it for the default"
        ) from None
    for name, v in (("BLOCK_M", block_m), ("TILE_N", tile_n)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{CASCADE_PREFIX_ENV}: {name}={v} must be a power of two >= 16")
    if (warps not in (1, 2, 4, 8, 16) or stages < 1 or per_sm <= 0
            or (maxnreg is not None and not 24 <= maxnreg <= 255)):
        raise ValueError(
            f"{CASCADE_PREFIX_ENV}={text!r}: num_warps must be 1/2/4/8/16, num_stages >= 1, "
            "programs_per_sm > 0, rMAXNREG within r24..r255"
        )
    return block_m, tile_n, warps, stages, per_sm, maxnreg


def prefix_config(
    *, num_tokens: int, num_heads: int, num_kv_heads: int, head_size: int, block_size: int,
    prefix_len: int, num_sms: int, override: str | None = None, itemsize: int = 2,
) -> PrefixConfig:
    """The prefix launch's shape: rows ``T * QPK`` per KV head in tiles of up to 64 (4
    warps; 16 in the interpreter), 64-token K/V tiles, 3 stages, two programs per SM (above
    head size 128 or for float32, `itemsize` 4: 32-token tiles, 2 stages, one per SM),
    and as many segments as fill that many programs on `num_sms` SMs, keeping at least
    `MIN_PREFIX_TILES_PER_SEGMENT` tiles per segment and the partials under
    `MAX_PREFIX_PARTIAL_BYTES`. `override` is ``PAGEDCORE_TRITON_CASCADE_PREFIX``'s text."""
    head_pad = triton.next_power_of_2(head_size)
    rows = num_tokens * (num_heads // num_kv_heads)
    per_sm = 1.0
    maxnreg = None
    if override:
        block_m, tile_n, warps, stages, per_sm, maxnreg = _parse_override(override)
    elif interpreting():
        block_m, tile_n, warps, stages = 16, max(16, block_size), 4, 1
    elif head_pad > 128 or itemsize > 2:  # bound registers and shared memory
        block_m = min(64, max(16, triton.next_power_of_2(rows)))
        tile_n, warps, stages = 32, 4, 2
    else:  # measured on the H200 (docs/benchmarks/h200_s12_cascade/): 64 x 64, 2 per SM
        block_m = min(64, max(16, triton.next_power_of_2(rows)))
        tile_n, warps, stages, per_sm = 64, 4, 3, 2.0
    m_tiles = -(-rows // block_m)
    tiles = -(-prefix_len // tile_n)
    base = m_tiles * num_kv_heads
    segments = max(1, int(num_sms * per_sm) // base)
    segments = min(segments, max(1, tiles // MIN_PREFIX_TILES_PER_SEGMENT))
    row_bytes = num_tokens * num_heads * (head_pad + 2) * 4
    segments = max(1, min(segments, MAX_PREFIX_PARTIAL_BYTES // max(1, row_bytes)))
    return PrefixConfig(block_m=block_m, tile_n=tile_n, num_warps=warps, num_stages=stages,
                        m_tiles=m_tiles, segments=segments, maxnreg=maxnreg)


def suffix_tiles(part: LaunchPart, *, num_queries_per_kv: int, head_size: int,
                 dtype: torch.dtype) -> TileConfig | None:
    """The suffix launch's tile shape (`SUFFIX_DECODE_TILES` for a decode step on a GPU in a
    16-bit dtype with head size <= 128, unless ``PAGEDCORE_TRITON_DECODE_TILES`` is set),
    or None for the launch's usual shape."""
    from pagedcore_triton.plan import DECODE_TILES_ENV, tile_config

    if (part.max_query_len != 1 or interpreting() or dtype.itemsize != 2 or head_size > 128
            or os.environ.get(DECODE_TILES_ENV)):
        return None
    base = tile_config(1, num_queries_per_kv, head_size, interpreting=False,
                       itemsize=dtype.itemsize, kv_itemsize=dtype.itemsize)
    return attrs.evolve(base, **SUFFIX_DECODE_TILES)


def overlap_enabled(device: torch.device) -> bool:
    """Whether cascade steps on `device` run their prefix launch beside the suffix launch
    (``PAGEDCORE_TRITON_CASCADE_OVERLAP=1`` on a CUDA device; never in the interpreter)."""
    value = os.environ.get(CASCADE_OVERLAP_ENV, "0").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{CASCADE_OVERLAP_ENV}={value!r}: expected 0 or 1 (unset it for "
                         "the default, 0)")
    return value == "1" and torch.device(device).type == "cuda" and not interpreting()


@functools.lru_cache(maxsize=8)
def _side_stream(device: torch.device) -> Any:
    return torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]


def _prefix_scratch(
    plan: CascadePlan, query: torch.Tensor, kv_cache: torch.Tensor
) -> tuple[PrefixConfig, torch.Tensor, torch.Tensor]:
    """The prefix launch's shape and its partials for this layer shape (allocated by the
    step's first layer, on the caller's stream)."""
    _, _, block_size, num_kv_heads, head_size = kv_cache.shape
    num_tokens, num_heads = plan.num_tokens, query.shape[1]
    key = (num_heads, query.dtype, tuple(kv_cache.shape))
    entry = plan.scratch.get(key)
    if entry is None:
        cfg = prefix_config(
            num_tokens=num_tokens, num_heads=num_heads, num_kv_heads=num_kv_heads,
            head_size=head_size, block_size=block_size, prefix_len=plan.prefix_len,
            num_sms=_num_sms(query.device), override=os.environ.get(CASCADE_PREFIX_ENV),
            itemsize=query.dtype.itemsize,
        )
        head_pad = triton.next_power_of_2(head_size)
        pfx_acc = torch.empty((num_tokens, num_heads, cfg.segments, head_pad),
                              dtype=torch.float32, device=query.device)
        pfx_ml = torch.empty((num_tokens, num_heads, cfg.segments, 2), dtype=torch.float32,
                             device=query.device)
        entry = plan.scratch[key] = (cfg, pfx_acc, pfx_ml)
    cfg, pfx_acc, pfx_ml = entry
    return cfg, pfx_acc, pfx_ml


def _launch_prefix(
    plan: CascadePlan,
    scratch: tuple[PrefixConfig, torch.Tensor, torch.Tensor],
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    *,
    scale: float,
    logits_soft_cap: float | None,
) -> None:
    from pagedcore_triton.kernels.cascade import cascade_prefix_kernel

    cfg, pfx_acc, pfx_ml = scratch
    _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
    num_heads = query.shape[1]
    stride_cs = num_kv_heads * head_size
    cascade_prefix_kernel[(cfg.m_tiles, num_kv_heads, cfg.segments)](
        query, kv_cache, num_blocks * block_size * stride_cs, plan.prefix_blocks, pfx_acc,
        pfx_ml, plan.num_tokens, plan.prefix_len,
        plan.prefix_blocks if plan.prefix_len_dev is None else plan.prefix_len_dev, scale,
        1.0 if logits_soft_cap is None else logits_soft_cap,
        query.stride(0), query.stride(1), block_size * stride_cs, stride_cs, head_size,
        HEAD_SIZE=head_size, HEAD_PAD=pfx_acc.shape[-1], BLOCK_SIZE=block_size,
        QPK=num_heads // num_kv_heads, BLOCK_M=cfg.block_m, TILE_N=cfg.tile_n,
        NUM_SEGMENTS=cfg.segments, USE_SOFTCAP=logits_soft_cap is not None,
        DOT_FP32=interpreting() or query.dtype == torch.float32, STAGES=cfg.num_stages,
        PREFIX_FROM_PTR=plan.prefix_len_dev is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({} if cfg.maxnreg is None else {"maxnreg": cfg.maxnreg}),
    )


def run_prefix(
    plan: CascadePlan,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    *,
    scale: float,
    logits_soft_cap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefix launch for one layer: its partials ``[T, Hq, S, HEAD_PAD]`` and
    ``[T, Hq, S, 2]`` float32."""
    scratch = _prefix_scratch(plan, query, kv_cache)
    _launch_prefix(plan, scratch, query, kv_cache, scale=scale,
                   logits_soft_cap=logits_soft_cap)
    return scratch[1], scratch[2]


def run_cascade(
    plan: CascadePlan,
    suffix: PreparedLaunch,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    output: torch.Tensor,
    *,
    scale: float,
    logits_soft_cap: float | None,
) -> None:
    """Attention of a cascade step for one layer, written into `output` ``[T, Hq, D]``.

    `suffix` is `plan.suffix_part` prepared by `pagedcore_triton.ops.prepare_launch` over
    `plan.suffix_seq_lens` / `plan.suffix_table`.
    """
    from pagedcore_triton.kernels.cascade import cascade_merge_kernel
    from pagedcore_triton.ops import run_launch

    if plan.num_tokens == 0:
        return
    scratch = _prefix_scratch(plan, query, kv_cache)
    _, pfx_acc, pfx_ml = scratch
    fused = suffix.part_acc is None
    if plan.overlap and not fused and query.is_cuda:
        # The prefix beside the suffix launch: fork onto the side stream, join before the
        # merge (both are captured as parallel branches under a CUDA graph).
        main = torch.cuda.current_stream(query.device)
        side = _side_stream(query.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            _launch_prefix(plan, scratch, query, kv_cache, scale=scale,
                           logits_soft_cap=logits_soft_cap)
        run_launch(suffix, query, kv_cache, output, scale=scale, alibi_slopes=None,
                   sliding_window=None, logits_soft_cap=logits_soft_cap, merge=False)
        main.wait_stream(side)
    else:
        _launch_prefix(plan, scratch, query, kv_cache, scale=scale,
                       logits_soft_cap=logits_soft_cap)
        run_launch(suffix, query, kv_cache, output, scale=scale, alibi_slopes=None,
                   sliding_window=None, logits_soft_cap=logits_soft_cap, merge=False,
                   prefix_partials=(pfx_acc, pfx_ml) if fused else None)
    if fused:
        return
    assert suffix.part_acc is not None and suffix.part_ml is not None
    num_heads, head_size = query.shape[1], query.shape[2]
    cascade_merge_kernel[(plan.num_tokens,)](
        output, suffix.part_acc, suffix.part_ml, pfx_acc, pfx_ml, num_heads,
        output.stride(0), output.stride(1),
        HEAD_SIZE=head_size, HEAD_PAD=pfx_acc.shape[-1],
        HEADS_PAD=triton.next_power_of_2(num_heads),
        SUFFIX_SEGMENTS=suffix.constexprs["NUM_SEGMENTS"], PREFIX_SEGMENTS=pfx_acc.shape[2],
        num_warps=4,
    )
