"""The Triton kernels against a float64 formula, on NaN-poisoned, randomly permuted caches.

Under TRITON_INTERPRET=1 (set by conftest.py without a GPU) shapes stay tiny.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from _reference import make_batch, reference_attention, rel_error
from pagedcore_triton import SplitRule, TritonAttentionBackend, TritonAttentionMetadata
from pagedcore_triton.plan import (
    LaunchPart,
    choose_num_segments,
    context_segments,
    context_split,
    parse_tiles,
)

from pagedcore.kv_cache.spec import FullAttentionSpec

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}
MIXED = [(5, 1), (70, 1), (0, 7), (33, 20)]  # (context, query): decodes, prefill, chunk


def _run(reqs: Sequence[tuple[int, int]], **kwargs: Any) -> tuple[float, TritonAttentionMetadata]:
    """Relative error against the formula and the plan of one step (see `_outputs`)."""
    out, ref, metadata = _outputs(reqs, **kwargs)
    return rel_error(out, ref), metadata


def _outputs(
    reqs: Sequence[tuple[int, int]],
    *,
    heads: tuple[int, int] = (8, 2),
    head_size: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    separate: bool = True,
    split: SplitRule | None = None,
    seed: int = 0,
    **features: Any,
) -> tuple[torch.Tensor, torch.Tensor, TritonAttentionMetadata]:
    """The impl's output, the float64 formula's (no sinks) and the plan of one step."""
    num_heads, num_kv_heads = heads
    batch = make_batch(
        reqs,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        block_size=block_size,
        dtype=dtype,
        device=DEVICE,
        num_padding=2,
        seed=seed,
    )
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype
    )
    builder = TritonAttentionBackend.get_builder_cls()(spec, ["layer.0"], torch.device(DEVICE))
    assert isinstance(builder, TritonAttentionBackend.get_builder_cls())
    builder.separate_decode_launch = separate  # type: ignore[attr-defined]
    if split is not None:
        builder.split_rule = split  # type: ignore[attr-defined]
    metadata = builder.build(batch.common)
    impl = TritonAttentionBackend.get_impl_cls()(
        num_heads, head_size, 0.125, num_kv_heads=num_kv_heads, **features
    )
    impl.do_kv_cache_update(batch.key, batch.value, batch.kv_cache, batch.common.slot_mapping)
    out = torch.full_like(batch.query, float("nan"))
    impl.forward(batch.query, batch.key, batch.value, batch.kv_cache, metadata, output=out)
    ref = reference_attention(
        batch,
        scale=0.125,
        alibi_slopes=features.get("alibi_slopes"),
        sliding_window=features.get("sliding_window"),
        logits_soft_cap=features.get("logits_soft_cap"),
    )
    return out[: batch.common.num_actual_tokens], ref, metadata


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_mixed_batch_dtypes(dtype: torch.dtype) -> None:
    err, metadata = _run(MIXED, dtype=dtype)
    assert len(metadata.parts) == 2  # decodes and prefills in separate launches
    assert err < TOL[dtype], err


@pytest.mark.parametrize(
    ("heads", "head_size", "block_size"),
    [((7, 1), 80, 32), ((8, 8), 256, 64), ((8, 1), 112, 16), ((4, 4), 192, 16)],
)
def test_head_and_block_sizes(heads: tuple[int, int], head_size: int, block_size: int) -> None:
    err, _ = _run(MIXED, heads=heads, head_size=head_size, block_size=block_size)
    assert err < TOL[torch.float32], err


def test_single_unified_launch() -> None:
    err, metadata = _run(MIXED, separate=False, heads=(8, 2), head_size=96)
    assert len(metadata.parts) == 1
    assert err < TOL[torch.float32], err


@pytest.mark.parametrize(
    "features",
    [
        {"sliding_window": 9},
        {"logits_soft_cap": 1.5},
        {"alibi_slopes": [0.5 ** (i + 1) for i in range(8)]},
        {"sliding_window": 17, "logits_soft_cap": 3.0, "alibi_slopes": [0.1] * 8},
    ],
)
def test_features(features: dict[str, Any]) -> None:
    err, _ = _run(MIXED, head_size=96, **features)
    assert err < TOL[torch.float32], err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_kv_decode(dtype: torch.dtype) -> None:
    rule = SplitRule(min_tokens_per_segment=16)
    err, metadata = _run([(100, 1), (37, 1), (0, 1)], dtype=dtype, split=rule, heads=(8, 2))
    assert metadata.parts[0].num_segments == 4
    assert err < TOL[dtype], err
    # A window leaves early segments empty: their (max=-inf, sum=0) must weigh nothing.
    err, _ = _run([(100, 1), (37, 1)], split=rule, sliding_window=20, seed=1)
    assert err < TOL[torch.float32], err


def _resolved_parts(metadata: TritonAttentionMetadata) -> list[Any]:
    """The parts the impl ran after its context split (`TritonAttentionImpl._context_split`)."""
    return [v for k, v in metadata.launches.items() if k[0] == "context_split"]


@pytest.mark.parametrize(
    ("separate", "features"),
    [(True, {}), (False, {}), (True, {"sliding_window": 150, "logits_soft_cap": 2.0})],
)
def test_context_split_prefill(separate: bool, features: dict[str, Any]) -> None:
    """Short queries over long contexts (a prefix hit's remainder) split their contexts:
    the split result equals the formula (NaN-poisoned cache), with the features the kernel
    folds per segment (a window leaving segments empty, soft-cap)."""
    rule = SplitRule(context_min_tokens=32)
    reqs = [(300, 6), (5, 1), (260, 3)] if not separate else [(300, 6), (260, 3)]
    err, metadata = _run(reqs, split=rule, separate=separate, **features)
    prefill = metadata.parts[-1]
    assert prefill.context_segments == 8, prefill  # 306 tokens / 8 >= 32
    resolved = _resolved_parts(metadata)
    assert resolved and resolved[-1].num_segments > 1 and not resolved[-1].tma_prefill
    assert err < TOL[torch.float32], err


def test_context_split_with_sinks_equals_one_pass() -> None:
    """Sink logits join segment 0's softmax only: the split output equals the one-pass one."""
    reqs = [(300, 6), (260, 3)]
    features = {"sinks": [0.5 - 0.1 * i for i in range(8)]}
    split, _, metadata = _outputs(reqs, split=SplitRule(context_min_tokens=32), **features)
    assert _resolved_parts(metadata)[-1].num_segments > 1
    one, _, metadata = _outputs(reqs, split=SplitRule(context_ratio=10**9), **features)
    assert not _resolved_parts(metadata)
    assert rel_error(split, one) < TOL[torch.float32]


def test_context_split_only_where_contexts_dominate() -> None:
    rule = SplitRule(context_min_tokens=32)
    # A plain prefill and a chunk whose context is under 4x its query: one pass.
    _, metadata = _run([(0, 40), (100, 30)], split=rule)
    assert [p.context_segments for p in metadata.parts] == [1], metadata.parts
    assert not _resolved_parts(metadata)
    # Decodes never take the context split (they have their own, `choose_num_segments`).
    _, metadata = _run([(300, 1), (200, 1)], split=rule)
    assert metadata.parts[0].context_segments == 1


#: ``(query heads, KV heads, head size, requests, context, new tokens) -> segments``: the
#: fastest split of each context-dominated case on an H100 (132 SMs; 1 where splitting only
#: slowed the step or the context does not dominate), docs/benchmarks/h100_s30/README.md.
H100_BEST_SPLITS = {
    (14, 2, 64, 1, 4096, 64): 32, (14, 2, 64, 1, 4096, 16): 32, (14, 2, 64, 1, 16384, 64): 32,
    (14, 2, 64, 4, 4096, 64): 8, (14, 2, 64, 1, 0, 2048): 1, (14, 2, 64, 1, 1024, 512): 1,
    (32, 8, 128, 1, 4096, 64): 16, (32, 8, 128, 1, 16384, 128): 8,
    (32, 8, 128, 4, 4096, 64): 4, (32, 8, 128, 1, 0, 2048): 1,
}


@pytest.mark.parametrize(("shape", "best"), list(H100_BEST_SPLITS.items()))
def test_context_split_picks_the_measured_best(shape: tuple[int, ...], best: int) -> None:
    """The rule (`context_segments` in the builder, `context_split` in the impl) gives, for
    the GPU's tiles and 132 SMs, the split measured fastest for each case."""
    hq, hkv, d, batch, ctx, q = shape
    most = context_segments(SplitRule(), max_query_len=q, max_context_len=ctx,
                            max_seq_len=ctx + q)
    part = LaunchPart(req_begin=0, req_end=batch, token_begin=0, token_end=batch * q,
                      max_query_len=q, prefill_only=True, context_segments=most,
                      query_lens=(q,) * batch if most > 1 else ())
    got = 1 if most == 1 else context_split(part, num_heads=hq, num_kv_heads=hkv,
                                            head_size=d, itemsize=2, kv_itemsize=2,
                                            num_sms=132, interpreting=False)
    assert got == best


def test_split_rule() -> None:
    rule = SplitRule()
    few_long = {"num_reqs": 8, "num_kv_heads": 8, "max_seq_len": 32768, "max_query_len": 1}
    assert choose_num_segments(rule, **few_long) > 1
    many = {"num_reqs": 256, "num_kv_heads": 8, "max_seq_len": 1024, "max_query_len": 1}
    assert choose_num_segments(rule, **many) == 1
    prefill = {"num_reqs": 1, "num_kv_heads": 8, "max_seq_len": 32768, "max_query_len": 4}
    assert choose_num_segments(rule, **prefill) == 1


def test_cache_write_skips_padding() -> None:
    batch = make_batch(
        [(3, 5)], num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
        dtype=torch.float16, device=DEVICE, num_padding=3,
    )
    impl = TritonAttentionBackend.get_impl_cls()(4, 64, 0.1, num_kv_heads=2)
    before = batch.kv_cache.clone()
    impl.do_kv_cache_update(batch.key, batch.value, batch.kv_cache, batch.common.slot_mapping)
    flat = batch.kv_cache.view(2, -1, 2, 64)
    slots = batch.common.slot_mapping
    real = slots >= 0
    assert torch.equal(flat[0, slots[real]], batch.key[real])
    assert torch.equal(flat[1, slots[real]], batch.value[real])
    changed = ~(batch.kv_cache == before) & ~(torch.isnan(batch.kv_cache) & torch.isnan(before))
    assert int(changed.sum()) == 2 * int(real.sum()) * 2 * 64  # nothing else was touched


def test_bad_input_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="head size 72"):
        TritonAttentionBackend.get_impl_cls()(4, 72, 0.1)
    with pytest.raises(ValueError, match="cache_dtype"):
        TritonAttentionBackend.get_kv_cache_shape(4, 16, 2, 64, "int8")
    impl = TritonAttentionBackend.get_impl_cls()(4, 64, 0.1, num_kv_heads=2)
    cache = torch.zeros((2, 4, 16, 4, 64), device=DEVICE)
    key = torch.zeros((1, 2, 64), device=DEVICE)
    with pytest.raises(ValueError, match="get_kv_cache_shape"):
        impl.do_kv_cache_update(key, key, cache, torch.zeros(1, dtype=torch.int64, device=DEVICE))


@pytest.mark.parametrize(
    "tiles", ["64,16,4,3", "32,32,4,2,fwd", "64,32,4,2", "64,16,4,3,i32,m1", "32,32,4,2,m1"]
)
def test_prefill_tile_overrides(tiles: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tuning variants (PAGEDCORE_TRITON_PREFILL_TILES) compute the same attention."""
    monkeypatch.setenv("PAGEDCORE_TRITON_PREFILL_TILES", tiles)
    reqs = [(5, 1), (33, 20), (0, 37), (64, 64)]  # interior tiles, tails, exact multiples
    err, metadata = _run(reqs, separate=False, dtype=torch.float16)
    assert err < TOL[torch.float16], err
    (launch,) = metadata.launches.values()
    assert launch.constexprs["BLOCK_M"] == int(tiles.split(",")[0])
    assert launch.constexprs["LONGEST_FIRST"] == (not tiles.endswith("fwd"))
    assert launch.constexprs["OFF32"] == ("i32" in tiles)  # the test cache is small
    assert launch.constexprs["EDGE_STAGES"] == (1 if "m1" in tiles else None)


def test_bad_prefill_tile_override_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="BLOCK_M,TILE_N,WARPS,STAGES"):
        parse_tiles("128,64,4", 4)
    with pytest.raises(ValueError, match="powers of two"):
        parse_tiles("96,64,4,3", 4)
    with pytest.raises(ValueError, match="fwd"):
        parse_tiles("128,64,4,3,pf", 4)
    with pytest.raises(ValueError, match="at most once"):
        parse_tiles("128,64,4,3,i32,i32", 4)
    assert not parse_tiles("128,64,8,2,fwd", 4).longest_first
    cfg = parse_tiles("128,128,8,2,m1,i32", 4)
    assert (cfg.block_q, cfg.tile_n, cfg.num_warps, cfg.num_stages) == (32, 128, 8, 2)
    assert cfg.int32_offsets and cfg.unpipelined_edges and cfg.longest_first


def test_int32_offsets_only_for_small_caches() -> None:
    """``i32`` asks for int32 K/V offsets; a cache of 2**31 elements or more keeps int64."""
    from pagedcore_triton.ops import prepare_launch
    from pagedcore_triton.plan import LaunchPart

    part = LaunchPart(req_begin=0, req_end=1, token_begin=0, token_end=64, max_query_len=64)
    tiles = parse_tiles("64,16,4,3,i32", 4)
    small = (2, 1024, 16, 2, 64)  # 4M elements
    big = (2, 2**17, 16, 8, 128)  # 2**32 elements
    qsl = torch.tensor([0, 64], dtype=torch.int32)
    lens = torch.tensor([64], dtype=torch.int32)
    table = torch.zeros((1, 4), dtype=torch.int32)
    flags = []
    for shape in (small, big):
        launch = prepare_launch(
            part, query_shape=(64, 8, shape[-1]), dtype=torch.float16, kv_cache_shape=shape,
            query_start_loc=qsl, seq_lens=lens, block_table=table, causal=True,
            use_alibi=False, sliding_window=None, logits_soft_cap=None, tiles=tiles,
        )
        flags.append(launch.constexprs["OFF32"])
    assert flags == [True, False]


def test_prefill_tile_choice() -> None:
    """256 rows on 8 warps only for 16-bit prefill-only launches with head size <= 128."""
    from pagedcore_triton.plan import tile_config

    big = tile_config(2048, 4, 128, interpreting=False, prefill_only=True)
    assert (big.block_m, big.block_q, big.num_warps, big.tile_n) == (256, 64, 8, 64)
    assert big.int32_offsets and big.longest_first
    for kwargs in ({"prefill_only": False}, {"prefill_only": True, "itemsize": 4}):
        cfg = tile_config(2048, 4, 128, interpreting=False, **kwargs)  # type: ignore[arg-type]
        assert (cfg.block_m, cfg.num_warps) == (128, 4)
    assert tile_config(2048, 4, 256, interpreting=False, prefill_only=True).block_m == 64
    decode = tile_config(1, 4, 128, interpreting=False)
    assert (decode.block_m, decode.num_warps, decode.int32_offsets) == (16, 4, True)


def test_decode_tiles_follow_the_cache_element_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8 decodes take DECODE_TILES[1] (float16 operands), bf16 ones DECODE_TILES[2] (and
    SMALL_HEAD_DECODE_TILES at head sizes <= 64); the override reaches every variant and
    names what it expects when malformed."""
    from pagedcore_triton.plan import (
        DECODE_TILES,
        DECODE_TILES_ENV,
        SMALL_HEAD_DECODE_TILES,
        kv_convert,
        tile_config,
    )

    fp8 = tile_config(1, 4, 128, interpreting=False, kv_itemsize=1)
    bf16 = tile_config(1, 4, 128, interpreting=False, kv_itemsize=2)
    for cfg, want in ((fp8, DECODE_TILES[1]), (bf16, DECODE_TILES[2])):
        assert all(getattr(cfg, k) == v for k, v in want.items()), (cfg, want)
    assert fp8.tile_n == 2 * bf16.tile_n and fp8.kv_convert == 1 and bf16.kv_convert == 0
    # head sizes <= 64 (Qwen2-0.5B) take the small-head shapes: 2 warps in bf16, 64-token
    # fp8 tiles of 3 stages
    for itemsize, head_size in ((1, 64), (2, 64), (1, 32), (2, 48)):
        cfg = tile_config(1, 7, head_size, interpreting=False, kv_itemsize=itemsize)
        want = SMALL_HEAD_DECODE_TILES[itemsize]
        assert all(getattr(cfg, k) == v for k, v in want.items()), (itemsize, head_size, cfg)
    assert tile_config(1, 7, 64, interpreting=False, kv_itemsize=2).num_warps == 2
    assert tile_config(1, 7, 96, interpreting=False, kv_itemsize=2).num_warps == 4
    assert kv_convert(fp8, kv_fp8=True, itemsize=2, interpreting=False) == 1
    assert kv_convert(fp8, kv_fp8=True, itemsize=2, interpreting=True) == 0
    # prefills and the interpreter keep their own shapes
    assert tile_config(64, 4, 128, interpreting=False, kv_itemsize=1).kv_convert == 0
    assert tile_config(1, 4, 128, interpreting=True, kv_itemsize=1).tile_n == 16
    monkeypatch.setenv(DECODE_TILES_ENV, "64,8,2,cvt3,s,r128")
    cfg = tile_config(1, 4, 128, interpreting=False, kv_itemsize=1)
    assert (cfg.tile_n, cfg.num_warps, cfg.num_stages, cfg.kv_convert, cfg.maxnreg,
            cfg.skip_interior_masks) == (64, 8, 2, 3, 128, True)
    for bad in ("128,4", "100,4,3", "128,4,3,cvt4", "128,4,3,s,s"):
        monkeypatch.setenv(DECODE_TILES_ENV, bad)
        with pytest.raises(ValueError, match=r"TILE_N,WARPS,STAGES\[,FLAG...\]"):
            tile_config(1, 4, 128, interpreting=False)


def test_builder_marks_prefill_only_parts() -> None:
    """Decodes and prefills get separate parts; only the all-prefill part is prefill_only."""
    _, metadata = _run(MIXED)
    assert [p.prefill_only for p in metadata.parts] == [False, True]
    _, metadata = _run(MIXED, separate=False)
    assert [p.prefill_only for p in metadata.parts] == [False]
