"""The plan's arithmetic (CSR page arrays, decode/prefill split) checked against block tables,
and the plan-once-per-step contract, through the FlashInfer test double."""

from __future__ import annotations

import fi_double
import pytest
import torch
from pagedcore_flashinfer import FlashInferBackend, fi_api
from pagedcore_flashinfer.impl import FlashInferImpl
from pagedcore_flashinfer.metadata import (
    MIXED_MODE_ENV,
    PREFILL_KERNELS_ENV,
    FlashInferMetadata,
    FlashInferMetadataBuilder,
)
from pagedcore_flashinfer.planning import paged_kv

from pagedcore.attention.metadata import CommonAttentionMetadata
from pagedcore.kv_cache.spec import FullAttentionSpec


def _common(
    requests: list[tuple[int, int]], block_size: int, num_blocks: int, seed: int
) -> CommonAttentionMetadata:
    """(context_len, query_len) per request; blocks drawn from a random permutation (0 = null)."""
    gen = torch.Generator().manual_seed(seed)
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    seq_lens = [c + q for c, q in requests]
    width = max(-(-s // block_size) for s in seq_lens) + 1
    table = torch.zeros(len(requests), width, dtype=torch.int32)
    slots, positions = [], []
    for b, (ctx, q) in enumerate(requests):
        n = -(-(ctx + q) // block_size)
        table[b, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
        for pos in range(ctx, ctx + q):
            slots.append(int(table[b, pos // block_size]) * block_size + pos % block_size)
            positions.append(pos)
    qsl = torch.zeros(len(requests) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor([q for _, q in requests]), 0)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=lens,
        seq_lens_cpu=lens.clone(),
        num_reqs=len(requests),
        num_actual_tokens=int(qsl[-1]),
        max_query_len=max(q for _, q in requests),
        max_seq_len=max(seq_lens),
        block_table=table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
    )


@pytest.mark.parametrize("block_size", [1, 16, 5])
@pytest.mark.parametrize("seed", [0, 1])
def test_page_arrays_follow_the_block_table(block_size: int, seed: int) -> None:
    requests = [(0, 1), (33, 1), (16, 16), (7, 40), (0, 31)]
    common = _common(requests, block_size, num_blocks=200, seed=seed)
    pk = paged_kv(common.block_table, common.seq_lens_cpu, block_size, 1, 5)
    assert pk.indptr.dtype == pk.indices.dtype == pk.last_page_len.dtype == torch.int32
    expected_pages: list[int] = []
    for b in range(1, 5):
        s = int(common.seq_lens_cpu[b])
        n = -(-s // block_size)
        assert int(pk.indptr[b]) - int(pk.indptr[b - 1]) == n
        assert int(pk.last_page_len[b - 1]) == s - (n - 1) * block_size
        assert 1 <= int(pk.last_page_len[b - 1]) <= block_size
        expected_pages += common.block_table[b, :n].tolist()
    assert pk.indices.tolist() == expected_pages
    assert 0 not in expected_pages  # the null block is never referenced


def _builder(monkeypatch: pytest.MonkeyPatch, mode: str) -> FlashInferMetadataBuilder:
    monkeypatch.setenv(MIXED_MODE_ENV, mode)
    monkeypatch.setattr(fi_api, "load_flashinfer", lambda: fi_double.FakeFlashInfer())
    fi_double.REGISTRY.clear()
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="bfloat16")
    builder = FlashInferBackend.get_builder_cls()(spec, ["l0", "l1", "l2"], torch.device("cpu"))
    assert isinstance(builder, FlashInferMetadataBuilder)
    return builder


MIXED = [(40, 1), (3, 1), (100, 1), (0, 20), (17, 5)]


@pytest.mark.parametrize(
    ("mode", "requests", "decodes"),
    [("split", MIXED, 3), ("prefill", MIXED, 0), ("split", [(5, 2), (9, 1)], 0)],
    ids=["split", "prefill-only", "not-decode-first"],
)
def test_decode_prefill_split(
    monkeypatch: pytest.MonkeyPatch, mode: str, requests: list[tuple[int, int]], decodes: int
) -> None:
    builder = _builder(monkeypatch, mode)
    md = builder.build(_common(requests, 16, 64, seed=3))
    assert isinstance(md, FlashInferMetadata)
    assert md.num_decodes == md.num_decode_tokens == decodes
    assert (md.decode is None) == (decodes == 0)
    assert md.prefill is not None and md.prefill_qo_indptr is not None
    prefill_lens = torch.tensor([q for _, q in requests[decodes:]])
    assert md.prefill_qo_indptr.tolist() == [0, *torch.cumsum(prefill_lens, 0).tolist()]


def test_one_plan_per_step_for_all_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    builder = _builder(monkeypatch, "split")
    impls = [FlashInferImpl(4, 64, 0.125, num_kv_heads=2) for _ in builder.layer_names]
    cache = torch.randn(64, 2, 16, 2, 64, dtype=torch.bfloat16)
    for step in range(2):
        common = _common(MIXED, 16, 64, seed=step)
        md = builder.build(common)
        query = torch.randn(common.num_actual_tokens, 4, 64, dtype=torch.bfloat16)
        outs = [impl.forward(query, query, query, cache, md) for impl in impls]
        assert all(torch.equal(outs[0], o) for o in outs[1:])
    decode, prefill = fi_double.REGISTRY  # made once per builder, reused across steps
    assert (decode.kind, prefill.kind) == ("decode", "prefill")
    assert len(decode.plans) == len(prefill.plans) == 2  # one per step, not per layer
    assert len(decode.runs) == len(prefill.runs) == 6
    # Layers whose plan() arguments differ get their own wrappers.
    capped = FlashInferImpl(4, 64, 0.125, num_kv_heads=2, logits_soft_cap=30.0)
    capped.forward(query, query, query, cache, md)
    assert len(fi_double.REGISTRY) == 4
    assert fi_double.REGISTRY[2].plans[0]["logits_soft_cap"] == 30.0


def test_stale_plan_is_replanned(monkeypatch: pytest.MonkeyPatch) -> None:
    builder = _builder(monkeypatch, "prefill")
    impl = FlashInferImpl(4, 64, 0.125, num_kv_heads=2)
    cache = torch.randn(64, 2, 16, 2, 64, dtype=torch.bfloat16)
    first, second = _common(MIXED, 16, 64, seed=0), _common(MIXED[:2], 16, 64, seed=1)
    md1, md2 = builder.build(first), builder.build(second)
    q1 = torch.randn(first.num_actual_tokens, 4, 64, dtype=torch.bfloat16)
    q2 = torch.randn(second.num_actual_tokens, 4, 64, dtype=torch.bfloat16)
    impl.forward(q2, q2, q2, cache, md2)
    impl.forward(q1, q1, q1, cache, md1)  # the wrapper holds md2's plan: it must re-plan
    (wrapper,) = fi_double.REGISTRY
    assert len(wrapper.plans) == 2 and wrapper.plans[-1]["qo_indptr"][-1] == q1.shape[0]


def test_bad_mixed_mode_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=MIXED_MODE_ENV):
        _builder(monkeypatch, "both")


@pytest.mark.parametrize("kernels", ["", "fa2", "FA3"])
def test_prefill_kernels_reach_the_prefill_wrapper(
    monkeypatch: pytest.MonkeyPatch, kernels: str
) -> None:
    monkeypatch.setenv(PREFILL_KERNELS_ENV, kernels)
    builder = _builder(monkeypatch, "prefill")
    cache = torch.randn(64, 2, 16, 2, 64, dtype=torch.bfloat16)
    common = _common(MIXED, 16, 64, seed=0)
    query = torch.randn(common.num_actual_tokens, 4, 64, dtype=torch.bfloat16)
    FlashInferImpl(4, 64, 0.125, num_kv_heads=2).forward(
        query, query, query, cache, builder.build(common))
    (wrapper,) = fi_double.REGISTRY
    assert wrapper.kwargs["backend"] == (kernels.lower() or "auto")


def test_bad_prefill_kernels_name_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PREFILL_KERNELS_ENV, "fa4")
    with pytest.raises(ValueError, match=f"{PREFILL_KERNELS_ENV}='fa4'.*'fa2'"):
        _builder(monkeypatch, "split")
