"""Contract tests of the flex backend: declarations, the plan's arithmetic against block
tables, and NaN safety of masked key rows, with the reference backend as the oracle."""

from __future__ import annotations

import pytest
import torch
from pagedcore_flex import FlexBackend
from pagedcore_flex.impl import FlexImpl
from pagedcore_flex.metadata import FlexMetadata, FlexMetadataBuilder, bucket_length

import pagedcore
from pagedcore import AttentionConfig
from pagedcore.attention.metadata import CommonAttentionMetadata
from pagedcore.kv_cache.spec import FullAttentionSpec
from pagedcore.reference.backend import ReferenceBackend

BLOCK = 4
HEAD = 16
NUM_BLOCKS = 12


def common_for(
    requests: list[tuple[int, int]], block_table: list[list[int]]
) -> CommonAttentionMetadata:
    """Common metadata for (context_len, query_len) requests over `block_table`."""
    qlens = [q for _, q in requests]
    seq_lens = torch.tensor([c + q for c, q in requests], dtype=torch.int32)
    qsl = torch.zeros(len(requests) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(qlens), 0)
    bt = torch.tensor(block_table, dtype=torch.int32)
    positions = torch.cat([torch.arange(c, c + q) for c, q in requests])
    slots = torch.cat(
        [bt[r, positions_r // BLOCK].long() * BLOCK + positions_r % BLOCK
         for r, positions_r in enumerate(torch.arange(c, c + q) for c, q in requests)]
    )
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq_lens,
        seq_lens_cpu=seq_lens.clone(), num_reqs=len(requests),
        num_actual_tokens=int(qsl[-1]), max_query_len=max(qlens),
        max_seq_len=int(seq_lens.max()), block_table=bt, slot_mapping=slots,
        positions=positions, causal=True,
    )


def build(common: CommonAttentionMetadata, num_kv_heads: int = 2) -> FlexMetadata:
    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=num_kv_heads, head_size=HEAD, dtype="float32"
    )
    builder = FlexBackend.get_builder_cls()(spec, ["layer.0"], torch.device("cpu"))
    metadata = builder.build(common)
    assert isinstance(metadata, FlexMetadata)
    return metadata


def test_declarations_match_selection() -> None:
    assert FlexBackend.is_available() is None
    cfg = AttentionConfig(head_size=64, dtype="float32", block_size=16, device="cpu",
                          sliding_window=8, use_alibi=True, logits_soft_cap=30.0)
    assert FlexBackend.validate_configuration(cfg) == []
    bad = AttentionConfig(head_size=80, dtype="float16", block_size=16, device="cpu",
                          kv_cache_dtype="fp8_e4m3")
    reasons = FlexBackend.validate_configuration(bad)
    assert any(r.startswith("head size 80") for r in reasons)
    assert any("kv_cache_dtype" in r for r in reasons)
    chosen = pagedcore.select_backend(head_size=64, dtype="float32", block_size=16,
                                      device="cpu", backend="flex")
    assert chosen is FlexBackend
    assert FlexBackend.get_kv_cache_shape(5, 16, 2, 64) == (2, 5, 16, 2, 64)
    with pytest.raises(ValueError, match="cache_dtype 'fp8_e4m3'"):
        FlexBackend.get_kv_cache_shape(5, 16, 2, 64, "fp8_e4m3")
    with pytest.raises(ValueError, match="kv_cache_dtype='auto'"):
        FlexImpl(4, HEAD, 0.25, num_kv_heads=2, kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="head size 80 is not supported by the flex backend"):
        FlexImpl(4, 80, 0.25, num_kv_heads=2)


def test_bucket_lengths() -> None:
    assert [bucket_length(n, device_type="cpu") for n in (1, 128, 129, 300)] == [
        128, 128, 256, 384]
    assert [bucket_length(n, device_type="cuda") for n in (1, 129, 300, 1025)] == [
        128, 256, 512, 2048]


def test_plan_arithmetic_follows_the_block_table() -> None:
    # Request 0: 3 cached + 2 new tokens (seq 5) in blocks 7, 2; request 1: decode at pos 6
    # (seq 7) in blocks 5, 9.
    common = common_for([(3, 2), (6, 1)], [[7, 2, 0], [5, 9, 0]])
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=HEAD, dtype="float32")
    builder = FlexMetadataBuilder(spec, ["layer.0"], torch.device("cpu"))
    # The packed layout directly (on CPU the batched one has fewer scores for this step).
    md = builder._build_packed(common, torch.tensor([5, 7]), torch.tensor([2, 1]))
    assert (md.flex_batch, md.padded_query_len, md.padded_kv_len) == (1, 128, 128)
    q_req, q_pos, q_rows = md.q_req[0], md.q_pos[0], md.q_rows[0]
    assert q_req[:3].tolist() == [0, 0, 1] and set(q_req[3:].tolist()) == {-1}
    assert q_pos[:3].tolist() == [3, 4, 6]
    assert q_rows[:3].tolist() == [0, 1, 2] and set(q_rows[3:].tolist()) == {-1}
    kv_req, kv_pos = md.kv_req[0], md.kv_pos[0]
    assert kv_req[:12].tolist() == [0] * 5 + [1] * 7
    assert set(kv_req[12:].tolist()) == {-2}
    assert kv_pos[:12].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]
    expected = [28, 29, 30, 31, 8, 20, 21, 22, 23, 36, 37, 38]  # req 0: blocks 7, 2; req 1: 5, 9
    assert md.kv_slots[0, :12].tolist() == expected
    live = md.kv_live(None)[0]
    assert live[:12].all() and not live[12:].any()
    # Window 2: request 0's queries start at 3, so keys >= 2 are live; request 1's at 6: >= 5.
    assert md.kv_live(2)[0, :12].tolist() == [False, False, True, True, True] + [False] * 5 + [
        True, True]


def test_decode_plan_has_one_flex_row_per_request() -> None:
    # Decodes at positions 4 (blocks 3, 6) and 1 (block 8); the second row's keys past its
    # length are padding that gathers slot 0 and is dead.
    common = common_for([(4, 1), (1, 1)], [[3, 6], [8, 0]])
    md = build(common)
    assert (md.flex_batch, md.padded_query_len, md.padded_kv_len) == (2, 1, 128)
    assert md.q_rows.tolist() == [[0], [1]] and md.q_pos.tolist() == [[4], [1]]
    assert md.kv_slots[0, :5].tolist() == [12, 13, 14, 15, 24]
    assert md.kv_slots[1, :2].tolist() == [32, 33] and set(md.kv_slots[1, 2:].tolist()) == {0}
    assert md.kv_req[1, :3].tolist() == [1, 1, -2]
    assert md.kv_live(None).sum(dim=1).tolist() == [5, 2]
    assert md.kv_live(2)[0, :5].tolist() == [False, False, False, True, True]


def test_cpu_picks_the_batched_layout_when_it_has_fewer_scores() -> None:
    # Two short chunks over short histories: 2 x 3 x 128 scores batched vs 128 x 128 packed.
    common = common_for([(20, 3), (30, 2)], [[1, 2, 3, 4, 5, 6, 0, 0, 0], [7, 8, 9, 10, 11,
                                                                          6, 5, 4, 3]])
    md = build(common)
    assert (md.flex_batch, md.padded_query_len) == (2, 3)
    assert md.q_rows.tolist() == [[0, 1, 2], [3, 4, -1]]
    assert md.q_pos.tolist() == [[20, 21, 22], [30, 31, 0]]
    assert md.q_req.tolist() == [[0, 0, 0], [1, 1, -1]]
    assert md.kv_first_q[:, 0].tolist() == [20, 30]
    assert md.kv_slots[1, 27:30].tolist() == [5 * BLOCK + 3, 4 * BLOCK, 4 * BLOCK + 1]
    flex, ref = run_both([(20, 3), (30, 2)], [[1, 2, 3, 4, 5, 6, 0, 0, 0], [7, 8, 9, 10, 11,
                                                                            6, 5, 4, 3]],
                         sliding_window=5, alibi=True)
    assert torch.isfinite(flex).all()
    torch.testing.assert_close(flex, ref, rtol=1e-4, atol=1e-5)


def test_builder_rejects_a_too_narrow_block_table() -> None:
    common = common_for([(3, 2)], [[7, 2]])
    object.__setattr__(common, "block_table", common.block_table[:, :1])
    with pytest.raises(ValueError, match="block_table has 1 columns"):
        build(common)


def run_both(
    requests: list[tuple[int, int]], block_table: list[list[int]], *,
    sliding_window: int | None = None, alibi: bool = False, soft_cap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(flex output, reference output) over one NaN-poisoned cache."""
    torch.manual_seed(0)
    common = common_for(requests, block_table)
    hq, hkv = 4, 2
    kv_cache = torch.full((2, NUM_BLOCKS, BLOCK, hkv, HEAD), float("nan"))
    t = common.num_actual_tokens
    # The history is written through slots too: every position < context_len.
    hist = [(r, p) for r, (c, _) in enumerate(requests) for p in range(c)]
    bt = common.block_table.long()
    hist_slots = torch.tensor([int(bt[r, p // BLOCK]) * BLOCK + p % BLOCK for r, p in hist],
                              dtype=torch.int64)
    query = torch.randn(t, hq, HEAD)
    key, value = torch.randn(t, hkv, HEAD), torch.randn(t, hkv, HEAD)
    kwargs: dict[str, object] = {"num_kv_heads": hkv, "sliding_window": sliding_window,
                                 "logits_soft_cap": soft_cap,
                                 "alibi_slopes": [0.5, 0.25, 0.125, 0.0625] if alibi else None}
    outs = []
    for backend in (FlexBackend, ReferenceBackend):
        impl = backend.get_impl_cls()(hq, HEAD, HEAD**-0.5, **kwargs)  # type: ignore[arg-type]
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=hkv, head_size=HEAD,
                                 dtype="float32")
        md = backend.get_builder_cls()(spec, ["l"], torch.device("cpu")).build(common)
        cache = kv_cache.clone()
        if len(hist):
            g = torch.Generator().manual_seed(1)
            impl.do_kv_cache_update(torch.randn(len(hist), hkv, HEAD, generator=g),
                                    torch.randn(len(hist), hkv, HEAD, generator=g), cache,
                                    hist_slots)
        impl.do_kv_cache_update(key, value, cache, common.slot_mapping)
        outs.append(impl.forward(query, key, value, cache, md))
    return outs[0], outs[1]


@pytest.mark.parametrize(("alibi", "decode"), [(False, False), (True, False), (True, True)])
def test_window_over_nan_blocks_matches_reference(alibi: bool, decode: bool) -> None:
    # Blocks that fell out of the window point at NaN-filled blocks (here: never written),
    # unused slots of the last blocks are NaN, and padding key rows read the null block 0.
    flex, ref = run_both([(11 if decode else 9, 1 if decode else 3), (13, 1)],
                         [[1, 2, 3, 0], [4, 5, 6, 8]], sliding_window=3, alibi=alibi,
                         soft_cap=2.0)
    assert torch.isfinite(flex).all()
    torch.testing.assert_close(flex, ref, rtol=1e-4, atol=1e-5)


def test_masked_nan_rows_would_leak_without_zeroing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The zeroing of invisible rows is what keeps NaN out: flex multiplies masked
    probabilities by V, and ``0 * NaN`` is NaN."""
    monkeypatch.setattr(FlexMetadata, "kv_live", lambda self, w: torch.ones_like(self.kv_req,
                                                                                  dtype=torch.bool))
    flex, _ = run_both([(9, 3)], [[1, 2, 3, 0]], sliding_window=3)
    assert torch.isnan(flex).any()
    decode, _ = run_both([(9, 1), (2, 1)], [[1, 2, 3, 0], [4, 0, 0, 0]], sliding_window=3)
    assert torch.isnan(decode).any()



def test_compiled_calls_get_room_for_every_bucket() -> None:
    """Dynamo's default recompile limit (8) would drop compiled flex to eager silently after
    a few buckets; compiled (CUDA) calls run with a higher one, eager calls untouched."""
    import torch._dynamo
    from pagedcore_flex.impl import RECOMPILE_LIMIT, _recompile_room

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    before = getattr(config, name)
    with _recompile_room(torch.device("cuda")):
        assert getattr(config, name) == RECOMPILE_LIMIT
    with _recompile_room(torch.device("cpu")):
        assert getattr(config, name) == before
    assert getattr(config, name) == before


def test_unavailable_reasons_name_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    from pagedcore_flex import availability

    monkeypatch.setattr(torch, "__version__", "2.4.1+cu121")
    assert availability.availability_problem() == (
        "torch 2.4.1+cu121 is too old: FlexAttention needs torch>=2.5; upgrade torch or "
        "choose another backend"
    )
    monkeypatch.setattr(torch, "__version__", "2.13.0")
    real_import = importlib.import_module

    def no_flex(name: str) -> object:
        if name == "torch.nn.attention.flex_attention":
            raise ImportError("no module named flex_attention")
        return real_import(name)

    monkeypatch.setattr(importlib, "import_module", no_flex)
    why = FlexBackend.is_available()
    assert why is not None and why.startswith("torch.nn.attention.flex_attention cannot be")
    cfg = AttentionConfig(head_size=64, dtype="float32", block_size=16, device="cpu")
    assert FlexBackend.validate_configuration(cfg) == [f"not available: {why}"]
