"""The Hopper prefill kernel (``kernels/prefill_tma.py``) and when the builder and impl use it.

On CPU the kernel runs in Triton's interpreter (which executes tensor-descriptor loads too),
forced by ``PAGEDCORE_TRITON_PREFILL_KERNEL=tma``; on an sm_90 GPU it is the default. Each
batch has padding tokens whose query/key/value rows are NaN, on a NaN-poisoned cache, against
the float64 formula of the tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import pytest
import torch
from _reference import make_batch, reference_attention, rel_error
from pagedcore_triton import TritonAttentionBackend
from pagedcore_triton.plan_tma import (
    PREFILL_KERNEL_ENV,
    TMA_TILES_ENV,
    parse_tma_tiles,
    tma_prefill_device,
    tma_tile_config,
)

from pagedcore.kv_cache.spec import FullAttentionSpec

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}
#: The tests' dtype: float32 in the interpreter; float16 on a GPU, where the kernel serves
#: 16-bit dtypes only (`tma_layer_reason`: a float32 layer runs the gather kernel there).
DTYPE = torch.float32 if DEVICE == "cpu" else torch.float16


def _run(
    reqs: Sequence[tuple[int, int]],
    *,
    heads: tuple[int, int] = (8, 2),
    head_size: int = 64,
    dtype: torch.dtype = DTYPE,
    causal: bool = True,
    key_layout: str = "contiguous",
    **features: Any,
) -> tuple[float, bool]:
    """``(relative error, whether the Hopper kernel ran)`` for `reqs` = ``[(ctx, q)]``."""
    num_heads, num_kv_heads = heads
    batch = make_batch(reqs, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_size=head_size, block_size=16, dtype=dtype, device=DEVICE,
                       num_padding=2, seed=3)
    n = batch.common.num_actual_tokens
    for t in (batch.query, batch.key, batch.value):
        t[n:] = float("nan")  # padding rows: never read into a real output row
    common = attrs.evolve(batch.common, causal=causal)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=num_kv_heads, head_size=head_size,
                             dtype=dtype)
    builder = TritonAttentionBackend.get_builder_cls()(spec, ["l0"], torch.device(DEVICE))
    metadata = builder.build(common)
    impl = TritonAttentionBackend.get_impl_cls()(num_heads, head_size, 0.125,
                                                 num_kv_heads=num_kv_heads, **features)
    impl.do_kv_cache_update(batch.key, batch.value, batch.kv_cache, common.slot_mapping)
    key, value = batch.key, batch.value
    if key_layout == "strided":  # [T, Hkv, D] whose heads are not adjacent rows
        key = torch.cat([key, key], dim=1)[:, ::2]
    out = torch.full_like(batch.query, float("nan"))
    impl.forward(batch.query, key, value, batch.kv_cache, metadata, output=out)
    ref = reference_attention(batch, scale=0.125, causal=causal, **features)
    ran = any(k[0] == "tma" for k in metadata.launches)
    return rel_error(out[:n], ref), ran


@pytest.fixture
def tma(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setenv(PREFILL_KERNEL_ENV, "tma")
    return monkeypatch


#: Decode-first as the engine orders a step: decodes, fresh prefills, chunks with a prefix
#: (block-aligned or not), lengths that are not multiples of the tiles.
MIXED = [(5, 1), (70, 1), (0, 37), (0, 7), (33, 20), (16, 45)]


@pytest.mark.parametrize(
    ("dtype", "heads", "head_size"),
    [(torch.float32, (8, 2), 64), (torch.bfloat16, (8, 2), 64), (torch.float16, (7, 1), 128)],
)
def test_mixed_batch(tma: pytest.MonkeyPatch, dtype: torch.dtype, heads: tuple[int, int],
                     head_size: int) -> None:
    err, ran = _run(MIXED, heads=heads, head_size=head_size, dtype=dtype)
    assert ran == (dtype != torch.float32 or DEVICE == "cpu")
    assert err < TOL[dtype], err


@pytest.mark.parametrize(
    "tiles", ["64,32,4,1,d16", "32,16,4,1,fwd,e1", "32,16,4,1,hm,r128", "16,16,4,1,wsk"]
)
def test_tile_variants(tma: pytest.MonkeyPatch, tiles: str) -> None:
    tma.setenv(TMA_TILES_ENV, tiles)
    err, ran = _run([(0, 70), (20, 45), (0, 3)])
    assert ran
    assert err < TOL[DTYPE], err


def test_not_causal(tma: pytest.MonkeyPatch) -> None:
    err, ran = _run([(0, 21), (9, 30)], causal=False)
    assert ran
    assert err < TOL[DTYPE], err


@pytest.mark.parametrize(
    "features",
    [{"sliding_window": 9}, {"logits_soft_cap": 2.0},
     {"alibi_slopes": [0.5 ** (i + 1) for i in range(8)]}, {"key_layout": "strided"}],
)
def test_layers_it_does_not_serve_fall_back(tma: pytest.MonkeyPatch,
                                            features: dict[str, Any]) -> None:
    err, ran = _run([(5, 1), (0, 30), (12, 20)], **features)
    assert not ran
    assert err < TOL[DTYPE], err


def test_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PREFILL_KERNEL_ENV, raising=False)
    cpu = torch.device("cpu")
    assert not tma_prefill_device(cpu, interpreting=True)  # other devices keep the gather
    monkeypatch.setenv(PREFILL_KERNEL_ENV, "tma")
    assert tma_prefill_device(cpu, interpreting=True)
    monkeypatch.setenv(PREFILL_KERNEL_ENV, "gather")
    assert not tma_prefill_device(torch.device("cuda"), interpreting=False)
    monkeypatch.setenv(PREFILL_KERNEL_ENV, "fast")
    with pytest.raises(ValueError, match="expected 'tma'"):
        tma_prefill_device(cpu, interpreting=False)
    # Head sizes the kernel has no box for, and decode-only steps, stay on the gather.
    monkeypatch.setenv(PREFILL_KERNEL_ENV, "tma")
    err, ran = _run([(0, 30), (4, 9)], head_size=96)
    assert not ran and err < TOL[DTYPE]
    err, ran = _run([(30, 1), (4, 1)])
    assert not ran and err < TOL[DTYPE]


def test_parse_tiles() -> None:
    cfg = parse_tma_tiles("128,128,8,3,d32", 4)
    assert (cfg.block_q, cfg.diag_tile_n, cfg.longest_first) == (32, 32, True)
    ws = tma_tile_config(4, 128, interpreting=False, override="128,128,4,2,wsk")
    assert (ws.tma_ws, ws.block_q, ws.num_warps) == (True, 128, 4)
    packed = tma_tile_config(4, 128, interpreting=False, override="128,128,4,2,wsk",
                             has_context=True)  # a cached prefix: the packed kernel
    assert (packed.tma_ws, packed.block_q, packed.num_warps) == (False, 32, 8)
    cfg = parse_tma_tiles("128,64,8,2,hm,r128", 4)
    assert (cfg.heads_fast, cfg.maxnreg, cfg.maxnreg is None) == (True, 128, False)
    for bad in ("128,128,8", "128,96,8,3", "128,128,8,3,d64", "128,128,8,3,zz",
                "128,64,8,2,r100", "128,64,8,2,r128,r96", "128,64,4,3,wsk",
                "128,128,4,2,p", "128,128,4,2,wsk,p,pf"):
        with pytest.raises(ValueError, match="PAGEDCORE_TRITON_TMA_TILES"):
            parse_tma_tiles(bad, 4)


def test_persistent_tiles_and_grid(monkeypatch: pytest.MonkeyPatch) -> None:
    """``wsk,p``: one program per SM (at most one per work item), the q-blocks in the ``hm``
    order, the key loop warp-specialized as in the one-program-per-q-block kernel."""
    from pagedcore_triton import ops_tma
    from pagedcore_triton.plan import LaunchPart

    monkeypatch.setattr(ops_tma, "interpreting", lambda: False)
    monkeypatch.setattr(ops_tma, "_programs_per_device", lambda device, interp: 100)
    qsl = torch.tensor([0, 100, 300], dtype=torch.int32)
    seq_lens = torch.tensor([100, 200], dtype=torch.int32)

    def plan(tiles: str, heads: int = 32) -> Any:
        part = LaunchPart(req_begin=0, req_end=2, token_begin=0, token_end=300,
                          max_query_len=200, prefill_only=True, tma_prefill=True,
                          has_context=False)
        return ops_tma.prepare_tma(part, num_heads=heads, dtype=torch.bfloat16,
                                   kv_cache_shape=(2, 20, 16, heads // 4, 128),
                                   query_start_loc=qsl, seq_lens=seq_lens,
                                   block_table=torch.zeros((2, 16), dtype=torch.int32),
                                   causal=True, tiles=parse_tma_tiles(tiles, 4))

    q_blocks = 300 // 128 + 2  # one spare q-block per request
    launch = plan("128,128,4,2,wsk,p")
    assert launch.grid == (100, 1, 1) and launch.static_args[2:] == (32, q_blocks, True)
    assert launch.constexprs["WARP_SPECIALIZE"] and "HEADS_FAST" not in launch.constexprs
    assert plan("128,128,4,2,wsk,p", heads=8).grid == (8 * q_blocks, 1, 1)
    assert parse_tma_tiles("128,128,4,2,wsk,p", 4).heads_fast
    assert plan("128,128,4,2,wsk").static_args[2:] == (32, q_blocks, False)


def test_register_cap_and_grid_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """``rN`` reaches the launch as ``maxnreg`` on a GPU, except for a cached prefix (whose
    gather spills under the cap); ``hm`` puts the KV heads on the grid's fast axis."""
    from pagedcore_triton import ops_tma
    from pagedcore_triton.plan import LaunchPart

    monkeypatch.setattr(ops_tma, "interpreting", lambda: False)
    qsl = torch.tensor([0, 100, 300], dtype=torch.int32)
    seq_lens = torch.tensor([100, 250], dtype=torch.int32)
    bt = torch.zeros((2, 16), dtype=torch.int32)

    def plan(has_context: bool, tiles: str) -> Any:
        part = LaunchPart(req_begin=0, req_end=2, token_begin=0, token_end=300,
                          max_query_len=200, prefill_only=True, tma_prefill=True,
                          has_context=has_context)
        return ops_tma.prepare_tma(part, num_heads=32, dtype=torch.bfloat16,
                                   kv_cache_shape=(2, 20, 16, 8, 128), query_start_loc=qsl,
                                   seq_lens=seq_lens, block_table=bt, causal=True,
                                   tiles=parse_tma_tiles(tiles, 4))

    fresh, cached = plan(False, "128,64,8,2,hm,r128"), plan(True, "128,64,8,2,hm,r128")
    assert fresh.constexprs["maxnreg"] == 128 and "maxnreg" not in cached.constexprs
    assert fresh.grid == (8, 300 // 32 + 2, 1) and fresh.constexprs["HEADS_FAST"]
    plain = plan(False, "128,64,8,2")
    assert plain.grid == (300 // 32 + 2, 8, 1) and "maxnreg" not in plain.constexprs


@pytest.mark.parametrize("causal", [True, False])
def test_warp_specialized_kernel(tma: pytest.MonkeyPatch, causal: bool) -> None:
    """``wsk``: prefills without a cached prefix on ``prefill_tma_ws_kernel`` (one query head
    per program, the mask on every tile); a part with a prefix keeps the packed kernel."""
    for tiles in ("16,16,4,1,wsk", "32,32,4,1,wsk,hm", "16,16,4,1,wsk,p"):
        tma.setenv(TMA_TILES_ENV, tiles)
        err, ran = _run([(0, 37), (0, 16), (0, 3)], causal=causal)
        assert ran and err < TOL[DTYPE], (tiles, err)
    err, ran = _run([(0, 37), (5, 20)], causal=causal)
    assert ran and err < TOL[DTYPE], err


def test_warp_specialized_request_search(tma: pytest.MonkeyPatch) -> None:
    """The unrolled binary search finds every request among many short ones."""
    tma.setenv(TMA_TILES_ENV, "16,16,4,1,wsk")
    err, ran = _run([(0, 5)] * 9 + [(0, 40), (0, 17)])
    assert ran and err < TOL[DTYPE], err


def test_default_tiles_for_head_size_128(monkeypatch: pytest.MonkeyPatch) -> None:
    """`TMA_DEFAULT_TILES_128` replaces the packed default for head size 128 on the GPU only;
    the override wins, and a cached prefix never gets a ``wsk`` default."""
    from pagedcore_triton import plan_tma

    monkeypatch.setattr(plan_tma, "TMA_DEFAULT_TILES_128", "128,128,4,2,wsk")
    cfg = plan_tma.tma_tile_config(4, 128, interpreting=False)
    assert cfg.tma_ws and cfg.num_warps == 4
    assert not plan_tma.tma_tile_config(4, 128, interpreting=False, has_context=True).tma_ws
    assert not plan_tma.tma_tile_config(4, 64, interpreting=False).tma_ws
    assert not plan_tma.tma_tile_config(4, 128, interpreting=True).tma_ws
    assert plan_tma.tma_tile_config(4, 128, interpreting=False,
                                    override="128,64,8,2").tile_n == 64
