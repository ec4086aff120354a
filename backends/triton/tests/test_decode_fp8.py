"""The fp8 single-token decode kernel (``kernels/decode_fp8.py``): each MODE against a float32
reference over the dequantized cache (unused slots NaN-poisoned, blocks in random order,
split-KV merges, sink logits), the launches routed to it, and its sm_90 compile (the
interpreter runs only its float32 branches); and the paged decode at the small-head tile
shape (`SMALL_HEAD_DECODE_TILES`), fp8 and float32, on the same kind of cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _sm90 import compile_script_for_sm90
from pagedcore_triton.ops import prepare_launch, run_launch
from pagedcore_triton.plan import LaunchPart, TileConfig, parse_decode_tiles

HQ, HKV, D, BS = 8, 2, 32, 16


def _case(dtype: torch.dtype, lens: list[int], seed: int, *, hq: int = HQ, hkv: int = HKV,
          d: int = D) -> dict[str, torch.Tensor]:
    """An fp8 (or float32) cache holding `lens` tokens per request (random block order, every
    other slot NaN), a float32 query and the reference without and with sink logits."""
    gen = torch.Generator().manual_seed(seed)
    b = len(lens)
    per = max(-(-n // BS) for n in lens)
    nb = b * per + 1
    table = (torch.randperm(nb - 1, generator=gen) + 1).view(b, per).to(torch.int32)
    cache = torch.empty((2, nb, BS, hkv, d), dtype=dtype)
    if dtype.itemsize == 1:
        cache.view(torch.uint8).fill_(0x7F)  # NaN in e4m3fn and e5m2
        fmax = 448.0 if dtype == torch.float8_e4m3fn else 57344.0
        scales = torch.tensor([0.02]), torch.tensor([0.03])
    else:
        cache.fill_(float("nan"))
        fmax, scales = float("inf"), (torch.tensor([1.0]), torch.tensor([1.0]))
    q = torch.randn((b, hq, d), generator=gen)
    sinks = torch.randn(hq, generator=gen)
    outs, outs_sink = [], []
    for r, n in enumerate(lens):
        kv = [(torch.randn((n, hkv, d), generator=gen) * 3 / s).clamp(-fmax, fmax).to(dtype)
              for s in scales]
        pos = torch.arange(n)
        blocks, slots = table[r, pos // BS].long(), pos % BS
        for i in range(2):
            cache[i, blocks, slots] = kv[i]
        k, v = (x.float() * s for x, s in zip(kv, scales, strict=True))
        k = k.repeat_interleave(hq // hkv, 1)  # [n, hq, d]
        v = v.repeat_interleave(hq // hkv, 1)
        s = torch.einsum("hd,nhd->hn", q[r], k) * d**-0.5
        outs.append(torch.einsum("hn,nhd->hd", s.softmax(-1), v))
        w = torch.cat([s, sinks[:, None]], -1).softmax(-1)[:, :-1]
        outs_sink.append(torch.einsum("hn,nhd->hd", w, v))
    return {"cache": cache, "table": table, "q": q, "seq": torch.tensor(lens, dtype=torch.int32),
            "qsl": torch.arange(b + 1, dtype=torch.int32), "ref": torch.stack(outs),
            "ref_sink": torch.stack(outs_sink), "sinks": sinks,
            "scales": scales}  # type: ignore[dict-item]


def _launch(c: dict[str, torch.Tensor], tiles: TileConfig, segments: int, **kw: object):
    b = c["q"].shape[0]
    part = LaunchPart(req_begin=0, req_end=b, token_begin=0, token_end=b, max_query_len=1,
                      num_segments=segments)
    return prepare_launch(
        part, query_shape=tuple(c["q"].shape), dtype=c["q"].dtype,  # type: ignore[arg-type]
        kv_cache_shape=tuple(c["cache"].shape), query_start_loc=c["qsl"], seq_lens=c["seq"],
        block_table=c["table"], causal=True, tiles=tiles,
        kv_fp8=c["cache"].dtype.itemsize == 1,
        **{"use_alibi": False, "sliding_window": None, "logits_soft_cap": None, **kw},
    )


@pytest.mark.parametrize(("dtype", "segments"), [(torch.float32, 1), (torch.float32, 2),
                                                  (torch.float8_e4m3fn, 1),
                                                  (torch.float8_e4m3fn, 2)])
def test_small_head_decode_tiles_match_the_reference(dtype: torch.dtype, segments: int) -> None:
    """The tile shape a GPU decode takes at Qwen2-0.5B's heads (14 query / 2 KV of 64:
    `SMALL_HEAD_DECODE_TILES`, 64-token tiles) computes the same attention over a NaN-poisoned
    cache: partial, whole and several tiles per request, one and two split segments (the
    interpreter ignores the warps and stages and runs float32 operands)."""
    if torch.cuda.is_available():
        pytest.skip("the interpreter's run of the GPU tile shape (the GPU sweep times it)")
    from pagedcore_triton.plan import SMALL_HEAD_DECODE_TILES, tile_config

    c = _case(dtype, [37, 130, 64], seed=11, hq=14, hkv=2, d=64)
    itemsize = min(dtype.itemsize, 2)  # (float32 stands in for bf16 in the interpreter)
    tiles = tile_config(1, 7, 64, interpreting=False, kv_itemsize=itemsize)
    want = SMALL_HEAD_DECODE_TILES[itemsize]
    assert all(getattr(tiles, k) == v for k, v in want.items()) and tiles.tile_n == 64
    launch = _launch(c, tiles, segments)
    assert launch.kernel == "paged" and launch.grid[1:] == (2, segments)
    out = torch.full_like(c["q"], float("nan"))
    run_launch(launch, c["q"], c["cache"], out, scale=64**-0.5, alibi_slopes=None,
               sliding_window=None, logits_soft_cap=None,
               kv_scales=c["scales"] if dtype.itemsize == 1 else None,  # type: ignore[arg-type]
               sinks=None)
    assert not out.isnan().any()
    assert float((out - c["ref"]).norm() / c["ref"].norm()) < 1e-5


@pytest.mark.parametrize(
    ("mode", "dtype", "segments", "with_sinks", "prefetch"),
    [(1, torch.float8_e4m3fn, 1, False, 1), (2, torch.float8_e5m2, 2, True, 0),
     (3, torch.float8_e4m3fn, 2, True, 2), (3, torch.float8_e5m2, 1, False, 0)],
)
def test_each_mode_matches_the_reference(mode: int, dtype: torch.dtype, segments: int,
                                         with_sinks: bool, prefetch: int) -> None:
    if torch.cuda.is_available():
        pytest.skip("runs the interpreter's float32 branches (the GPU sweep checks the rest)")
    c = _case(dtype, [37, 16, 70], seed=mode)
    tiles = TileConfig(block_m=16, block_q=4, tile_n=16, num_warps=4, num_stages=1,
                       fp8_decode=mode, fp8_prefetch=prefetch)
    launch = _launch(c, tiles, segments, use_sinks=with_sinks)
    assert launch.kernel == "fp8_decode" and launch.grid == (3, HKV, segments)
    out = torch.full_like(c["q"], float("nan"))
    run_launch(launch, c["q"], c["cache"], out, scale=D**-0.5, alibi_slopes=None,
               sliding_window=None, logits_soft_cap=None,
               kv_scales=c["scales"],  # type: ignore[arg-type]
               sinks=c["sinks"] if with_sinks else None)
    ref = c["ref_sink"] if with_sinks else c["ref"]
    assert not out.isnan().any()
    assert float((out - ref).norm() / ref.norm()) < 1e-5


def test_only_plain_fp8_decodes_are_routed() -> None:
    c = _case(torch.float8_e4m3fn, [20, 5], seed=0)
    tiles = TileConfig(block_m=16, block_q=4, tile_n=16, num_warps=4, num_stages=1,
                       fp8_decode=3)
    assert _launch(c, tiles, 1).kernel == "fp8_decode"
    for kw in ({"sliding_window": 8}, {"use_alibi": True}, {"logits_soft_cap": 30.0}):
        assert _launch(c, tiles, 1, **kw).kernel == "paged", kw
    assert _launch(c, TileConfig(block_m=16, block_q=4, tile_n=16, num_warps=4,
                                 num_stages=1), 1).kernel == "paged"


def test_decode_tiles_flags_pick_the_mode_and_rows() -> None:
    base = TileConfig(block_m=16, block_q=4, tile_n=64, num_warps=4, num_stages=3)
    cfg = parse_decode_tiles("128,8,3,k3,b8,i32,pf2", base)
    assert (cfg.fp8_decode, cfg.fp8_rows, cfg.tile_n, cfg.num_warps) == (3, 8, 128, 8)
    assert cfg.fp8_prefetch == 2
    assert parse_decode_tiles("64,4,3,k0", cfg).fp8_decode == 0
    with pytest.raises(ValueError, match=r"k0\.\.k3"):
        parse_decode_tiles("64,4,3,k7", base)


_SCRIPT = r"""
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from pagedcore_triton.kernels.decode_fp8 import fp8_decode_kernel as kernel

for mode, cache, rows, pf in ((3, "*fp8e4nv", 8, 2), (1, "*fp8e5", 16, 0)):
    c = dict(HEAD_SIZE=128, HEAD_PAD=128, BLOCK_SIZE=16, QPK=4, BLOCK_M=rows, TILE_N=64,
             NUM_SEGMENTS=2, MODE=mode, USE_SINKS=True, F32=False, OFF32=True, KV_FP8=True,
             PREFETCH=pf)
    types = {"out_ptr": "*bf16", "q_ptr": "*bf16", "k_cache_ptr": cache,
             "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "k_scale_ptr": "*fp32",
             "v_scale_ptr": "*fp32", "sinks_ptr": "*fp32", "scale": "fp32"}
    sig = {n: "constexpr" if n in c else types.get(n, "*i32" if n.endswith("_ptr") else "i32")
           for n in kernel.arg_names}
    triton.compile(ASTSource(kernel, sig, c), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": 4, "num_stages": 3})
    print("ok", mode, cache, flush=True)
"""


def test_fp8_decode_kernel_compiles_for_sm90(tmp_path: Path) -> None:
    stdout = compile_script_for_sm90(_SCRIPT, tmp_path)
    assert stdout.count("ok ") == 2, stdout
