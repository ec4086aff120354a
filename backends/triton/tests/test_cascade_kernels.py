"""The cascade launches on tiny shapes: the prefix split over several segments with a partial
last tile, the suffix launch's fused merge, and the split-suffix path's merge kernel, each
against the plain plan (NaN in every cache slot no request owns)."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch

from pagedcore.attention import CommonAttentionMetadata
from pagedcore.kv_cache.spec import FullAttentionSpec

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BS, HEADS, KV_HEADS, HEAD = 16, 4, 2, 64


def _step(prefix: int, owns: list[int], queries: list[int]) -> dict[str, Any]:
    """Requests sharing `prefix` tokens (the same blocks), then `own` cached tokens and
    `q` new query tokens each; unused slots and the null block hold NaN."""
    g = torch.Generator().manual_seed(7)
    n_pfx = prefix // BS
    tables, next_id = [], 1 + n_pfx
    seqs = [prefix + o + q for o, q in zip(owns, queries, strict=True)]
    for seq in seqs:
        n_own = -(-(seq - prefix) // BS)
        tables.append(list(range(1, 1 + n_pfx)) + list(range(next_id, next_id + n_own)))
        next_id += n_own
    cache = torch.randn((2, next_id, BS, KV_HEADS, HEAD), generator=g)
    cache[:, 0] = float("nan")
    for t, seq in zip(tables, seqs, strict=True):
        if seq % BS:
            cache[:, t[-1], seq % BS:] = float("nan")
    width = max(len(t) for t in tables) + 1
    table = torch.zeros((len(seqs), width), dtype=torch.int32)
    for r, t in enumerate(tables):
        table[r, : len(t)] = torch.tensor(t)
    qsl = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seqs, dtype=torch.int32)
    positions = torch.cat([torch.arange(s - q, s) for s, q in zip(seqs, queries, strict=True)])
    common = CommonAttentionMetadata(
        query_start_loc=qsl.to(DEVICE), query_start_loc_cpu=qsl, seq_lens=lens.to(DEVICE),
        seq_lens_cpu=lens, num_reqs=len(seqs), num_actual_tokens=int(qsl[-1]),
        max_query_len=max(queries), max_seq_len=max(seqs), block_table=table.to(DEVICE),
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64, device=DEVICE),
        positions=positions.to(DEVICE),
    )
    query = torch.randn((int(qsl[-1]), HEADS, HEAD), generator=g)
    return {"common": common, "cache": cache.to(DEVICE), "query": query.to(DEVICE)}


def _run(step: dict[str, Any], prefix: int, **builder_attrs: Any) -> tuple[Any, Any]:
    from pagedcore_triton import TritonAttentionBackend

    spec = FullAttentionSpec(block_size=BS, num_kv_heads=KV_HEADS, head_size=HEAD,
                             dtype="float32")
    builder = TritonAttentionBackend.get_builder_cls()(spec, ["l0"], torch.device(DEVICE))
    for k, v in builder_attrs.items():
        setattr(builder, k, v)
    impl = TritonAttentionBackend.get_impl_cls()(
        HEADS, HEAD, HEAD ** -0.5, num_kv_heads=KV_HEADS, alibi_slopes=None,
        sliding_window=None, logits_soft_cap=None, kv_cache_dtype="auto")
    q, cache = step["query"], step["cache"]
    plain = impl.forward(q, q, q, cache, builder.build(step["common"]))
    meta = builder.build(step["common"], common_prefix_len=prefix)
    assert meta.cascade is not None
    return plain, (impl.forward(q, q, q, cache, meta), meta)


@pytest.mark.parametrize("split_suffix", [False, True], ids=["fused_merge", "split_suffix"])
def test_cascade_segments_and_merges_match_plain(
    monkeypatch: pytest.MonkeyPatch, split_suffix: bool
) -> None:
    import pagedcore_triton.cascade as cascade
    from pagedcore_triton.plan import SplitRule

    # 9 prefix blocks in 32-token tiles: 5 tiles (the last one half full) over 4 segments
    # of 2 tiles (4 SMs x 2 programs / 2 KV heads): the last segment is left empty. The
    # plan is sized for 4 SMs (the interpreter's count) on a GPU too.
    monkeypatch.setattr(cascade, "_num_sms", lambda device: 4)
    monkeypatch.setattr(cascade, "MIN_PREFIX_TILES_PER_SEGMENT", 1)
    monkeypatch.setenv(cascade.CASCADE_PREFIX_ENV, "16,32,4,1,2")
    prefix = 9 * BS
    step = _step(prefix, owns=[5, 40, 17], queries=[1, 1, 1])
    extra = {"split_rule": SplitRule(min_programs=10**6, min_tokens_per_segment=16)}
    plain, (casc, meta) = _run(step, prefix, **(extra if split_suffix else {}))
    cfg = next(iter(meta.cascade.scratch.values()))[0]
    assert cfg.segments == 4 and cfg.m_tiles == 1, cfg
    assert (meta.cascade.suffix_part.num_segments > 1) == split_suffix
    assert not torch.isnan(casc).any()
    err = float((casc - plain).abs().max() / plain.abs().max())
    assert err < 1e-5, err


def test_cascade_mixed_step_rows_span_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """A mixed step (a 9-token chunk and two decodes after a 2-block prefix): 11 query
    tokens x 2 query heads per KV head = 22 rows, two 16-row prefix tiles (the interpreter's
    shape, asked for on a GPU too, where float32 would take one 32-row tile)."""
    import pagedcore_triton.cascade as cascade

    monkeypatch.setattr(cascade, "_num_sms", lambda device: 4)
    monkeypatch.setenv(cascade.CASCADE_PREFIX_ENV, "16,16,4,1,1")
    monkeypatch.setattr(cascade, "MIN_PREFIX_TILES_PER_SEGMENT", 1)
    prefix = 2 * BS
    step = _step(prefix, owns=[3, 0, 20], queries=[1, 9, 1])
    plain, (casc, meta) = _run(step, prefix)
    cfg = next(iter(meta.cascade.scratch.values()))[0]
    assert cfg.m_tiles == 2, cfg
    err = float((casc - plain).abs().max() / plain.abs().max())
    assert err < 1e-5, err


def test_cascade_long_chunk_runs_the_plain_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """A mixed step whose chunk holds more than `MAX_SUFFIX_ROWS` query rows per KV head
    (33 tokens x 2) runs the plain plan although the builder planned a cascade (on the H200
    such a suffix launch with its fused merge crashed ptxas); the same output."""
    import pagedcore_triton.cascade as cascade

    calls: list[int] = []
    real = cascade.run_cascade
    monkeypatch.setattr(cascade, "run_cascade",
                        lambda plan, *a, **k: (calls.append(1), real(plan, *a, **k))[1])
    prefix = 2 * BS
    for chunk, cascades in ((31, True), (33, False)):  # 31 x 2 = 62 rows fit, 66 do not
        calls.clear()
        step = _step(prefix, owns=[3, 0, 20], queries=[1, chunk, 1])
        plain, (casc, _meta) = _run(step, prefix)
        assert bool(calls) == cascades, chunk
        assert float((casc - plain).abs().max() / plain.abs().max()) < 1e-5


def test_prefix_override_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedcore_triton.cascade import CASCADE_PREFIX_ENV, prefix_config

    for bad in ("128,64", "100,64,8,3", "128,64,3,3"):
        with pytest.raises(ValueError, match=CASCADE_PREFIX_ENV):
            prefix_config(num_tokens=4, num_heads=4, num_kv_heads=2, head_size=64,
                          block_size=16, prefix_len=64, num_sms=4, override=bad)


def test_prefix_config_bounds_wide_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU: 64-row tiles, two programs per SM for 16-bit head size 128 (the H200's
    fastest); float32 and head size 256 take 32-token tiles on 2 stages."""
    import pagedcore_triton.cascade as cascade

    monkeypatch.setattr(cascade, "interpreting", lambda: False)
    kw = dict(num_tokens=64, num_heads=32, num_kv_heads=8, block_size=16, prefix_len=4096,
              num_sms=132)
    cfg = cascade.prefix_config(head_size=128, **kw)
    assert (cfg.block_m, cfg.tile_n, cfg.num_warps, cfg.m_tiles, cfg.segments) == (
        64, 64, 4, 4, 8)
    for wide in (cascade.prefix_config(head_size=256, **kw),
                 cascade.prefix_config(head_size=128, itemsize=4, **kw)):
        assert (wide.block_m, wide.tile_n, wide.num_stages) == (64, 32, 2), wide


def test_suffix_tiles_for_gpu_decode_cascades_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode cascade's suffix launch takes `SUFFIX_DECODE_TILES` on a GPU in 16-bit
    with head size <= 128; mixed steps, float32, head 256, the interpreter and a
    ``PAGEDCORE_TRITON_DECODE_TILES`` override keep the usual shape."""
    import pagedcore_triton.cascade as cascade
    from pagedcore_triton.plan import DECODE_TILES_ENV, LaunchPart

    monkeypatch.delenv(DECODE_TILES_ENV, raising=False)
    decode = LaunchPart(req_begin=0, req_end=4, token_begin=0, token_end=4, max_query_len=1)
    mixed = attrs.evolve(decode, max_query_len=9, token_end=12)
    kw = {"num_queries_per_kv": 4, "head_size": 128, "dtype": torch.bfloat16}
    monkeypatch.setattr(cascade, "interpreting", lambda: True)
    assert cascade.suffix_tiles(decode, **kw) is None
    monkeypatch.setattr(cascade, "interpreting", lambda: False)
    tiles = cascade.suffix_tiles(decode, **kw)
    assert tiles is not None
    assert (tiles.tile_n, tiles.num_warps, tiles.num_stages) == (32, 4, 4)
    assert tiles.block_m >= 16 and tiles.block_q == tiles.block_m // 4
    assert cascade.suffix_tiles(mixed, **kw) is None
    assert cascade.suffix_tiles(decode, **{**kw, "dtype": torch.float32}) is None
    assert cascade.suffix_tiles(decode, **{**kw, "head_size": 256}) is None
    monkeypatch.setenv(DECODE_TILES_ENV, "64,4,3")
    assert cascade.suffix_tiles(decode, **kw) is None


def test_overlap_switch_splits_the_suffix(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PAGEDCORE_TRITON_CASCADE_OVERLAP``: off unless ``1`` on a CUDA device, a bad value
    is named; with it on, a decode cascade's suffix launch splits at least in two and the
    plan overlaps (the suffix leaves partials for the merge while the prefix runs beside
    it; where the query is not on CUDA the launches run one after the other), the output
    equal to the plain plan's; a mixed step's unsplit suffix never overlaps."""
    import pagedcore_triton.cascade as cascade

    monkeypatch.delenv(cascade.CASCADE_OVERLAP_ENV, raising=False)
    assert not cascade.overlap_enabled(torch.device("cuda"))
    monkeypatch.setenv(cascade.CASCADE_OVERLAP_ENV, "1")
    assert not cascade.overlap_enabled(torch.device("cpu"))
    monkeypatch.setenv(cascade.CASCADE_OVERLAP_ENV, "yes")
    with pytest.raises(ValueError, match=cascade.CASCADE_OVERLAP_ENV):
        cascade.overlap_enabled(torch.device("cuda"))
    monkeypatch.delenv(cascade.CASCADE_OVERLAP_ENV)
    prefix = 2 * BS
    step = _step(prefix, owns=[5, 40, 17], queries=[1, 1, 1])
    _, (_, meta) = _run(step, prefix)
    assert meta.cascade.suffix_part.num_segments == 1 and not meta.cascade.overlap
    monkeypatch.setattr(cascade, "overlap_enabled", lambda device: True)
    plain, (casc, meta) = _run(step, prefix)
    assert meta.cascade.suffix_part.num_segments >= 2 and meta.cascade.overlap
    assert not torch.isnan(casc).any()
    assert float((casc - plain).abs().max() / plain.abs().max()) < 1e-5
    # A mixed step's suffix launch stays unsplit (it folds the prefix in): no overlap.
    mixed = _step(prefix, owns=[5, 0, 17], queries=[1, 4, 1])
    plain, (casc, meta) = _run(mixed, prefix)
    assert meta.cascade.suffix_part.num_segments == 1 and not meta.cascade.overlap
    assert float((casc - plain).abs().max() / plain.abs().max()) < 1e-5


def test_prefix_override_register_cap() -> None:
    """``...,rN`` caps the prefix launch's registers (tuning the programs per SM)."""
    from pagedcore_triton.cascade import CASCADE_PREFIX_ENV, prefix_config

    kw = dict(num_tokens=4, num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
              prefix_len=64, num_sms=4)
    assert prefix_config(override="64,32,4,3,3,r168", **kw).maxnreg == 168
    assert prefix_config(override="64,32,4,3,3", **kw).maxnreg is None
    for bad in ("64,32,4,3,3,r9", "64,32,4,3,3,168", "64,32,4,3,3,r168,x"):
        with pytest.raises(ValueError, match=CASCADE_PREFIX_ENV):
            prefix_config(override=bad, **kw)
