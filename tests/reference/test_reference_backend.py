"""The reference backend against a dense float64 formula written independently of it.

The oracle below works on unpaged K/V with plain loops over requests, heads and query tokens and
a dense per-query mask; the paged side goes through the backend's own API with permuted physical
blocks, NaN in every slot that holds no token, and NaN K/V/Q on ``-1`` padding tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedcore.attention.metadata import CommonAttentionMetadata
from pagedcore.kv_cache.spec import FullAttentionSpec
from pagedcore.reference import ReferenceBackend
from pagedcore.reference.metadata import ReferenceMetadataBuilder


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool = True,
    window: int | None = None,
    slopes: list[float] | None = None,
    cap: float | None = None,
) -> torch.Tensor:
    """One request: q ``[Lq, Hq, D]``, k/v ``[S, Hkv, D]`` float64 -> ``[Lq, Hq, D]``."""
    lq, hq, _ = q.shape
    s, hkv, _ = k.shape
    out = torch.zeros_like(q)
    for h in range(hq):
        kh = h // (hq // hkv)
        for i in range(lq):
            p = s - lq + i
            logits = []
            for j in range(s):
                if (causal and j > p) or (window is not None and p - j >= window):
                    logits.append(-math.inf)
                    continue
                x = scale * float(q[i, h] @ k[j, kh])
                if cap is not None:
                    x = cap * math.tanh(x / cap)
                if slopes is not None:
                    x += slopes[h] * (j - p)
                logits.append(x)
            w = torch.softmax(torch.tensor(logits, dtype=torch.float64), dim=0)
            out[i, h] = w @ v[:, kh]
    return out


@dataclass
class Case:
    ctx: list[int]
    qlen: list[int]
    block_size: int = 4
    hq: int = 4
    hkv: int = 2
    d: int = 8
    dtype: torch.dtype = torch.float32
    window: int | None = None
    alibi: bool = False
    cap: float | None = None
    pad: int = 0
    causal: bool = True


def run_case(case: Case, seed: int, device: str = "cpu") -> tuple[float, float]:
    """Return (max abs error, max |reference|) of the backend vs the dense oracle."""
    g = torch.Generator().manual_seed(seed)
    bsz, hq, hkv, d = case.block_size, case.hq, case.hkv, case.d
    seq = [c + q for c, q in zip(case.ctx, case.qlen, strict=True)]
    nblk = [-(-s // bsz) for s in seq]
    total = sum(nblk) + 3
    perm = (torch.randperm(total - 1, generator=g) + 1).tolist()
    table = torch.zeros(len(seq), max(nblk) + 2, dtype=torch.int32)
    it = iter(perm)
    for r, n in enumerate(nblk):
        for j in range(n):
            table[r, j] = next(it)

    ks = [torch.randn(s, hkv, d, generator=g, dtype=torch.float64) for s in seq]
    vs = [torch.randn(s, hkv, d, generator=g, dtype=torch.float64) for s in seq]
    qs = [torch.randn(q, hq, d, generator=g, dtype=torch.float64) for q in case.qlen]
    # Round once to the model dtype so both sides see the same numbers.
    ks = [x.to(case.dtype).to(torch.float64) for x in ks]
    vs = [x.to(case.dtype).to(torch.float64) for x in vs]
    qs = [x.to(case.dtype).to(torch.float64) for x in qs]
    slopes = [2.0 ** (-(h + 1) / 2) for h in range(hq)] if case.alibi else None
    scale = d**-0.5

    def slots(r: int, positions: range) -> list[int]:
        return [int(table[r, p // bsz]) * bsz + p % bsz for p in positions]

    backend = ReferenceBackend
    shape = backend.get_kv_cache_shape(total, bsz, hkv, d)
    cache = torch.full(shape, float("nan"), dtype=case.dtype, device=device)
    impl = backend.get_impl_cls()(
        hq, d, scale, num_kv_heads=hkv, alibi_slopes=slopes, sliding_window=case.window,
        logits_soft_cap=case.cap,
    )
    hist_slots = [s for r, c in enumerate(case.ctx) for s in slots(r, range(c))]
    if hist_slots:
        impl.do_kv_cache_update(
            torch.cat([k[:c] for k, c in zip(ks, case.ctx, strict=True)]).to(device, case.dtype),
            torch.cat([v[:c] for v, c in zip(vs, case.ctx, strict=True)]).to(device, case.dtype),
            cache,
            torch.tensor(hist_slots, dtype=torch.int64, device=device),
        )
    new_slots = [s for r, (c, n) in enumerate(zip(case.ctx, seq, strict=True))
                 for s in slots(r, range(c, n))]
    nan = torch.full((case.pad, hkv, d), float("nan"), dtype=case.dtype)
    key = torch.cat([k[c:] for k, c in zip(ks, case.ctx, strict=True)]).to(case.dtype)
    value = torch.cat([v[c:] for v, c in zip(vs, case.ctx, strict=True)]).to(case.dtype)
    key, value = torch.cat([key, nan]), torch.cat([value, nan])
    query = torch.cat([*(q.to(case.dtype) for q in qs),
                       torch.full((case.pad, hq, d), float("nan"), dtype=case.dtype)])
    slot_mapping = torch.tensor(new_slots + [-1] * case.pad, dtype=torch.int64, device=device)
    key, value, query = key.to(device), value.to(device), query.to(device)
    impl.do_kv_cache_update(key, value, cache, slot_mapping)

    qsl = torch.tensor([0, *torch.tensor(case.qlen).cumsum(0).tolist()], dtype=torch.int32)
    seq_t = torch.tensor(seq, dtype=torch.int32)
    positions = torch.tensor(
        [p for c, n in zip(case.ctx, seq, strict=True) for p in range(c, n)] + [0] * case.pad
    )
    common = CommonAttentionMetadata(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl, seq_lens=seq_t.to(device),
        seq_lens_cpu=seq_t, num_reqs=len(seq), num_actual_tokens=sum(case.qlen),
        max_query_len=max(case.qlen), max_seq_len=max(seq), block_table=table.to(device),
        slot_mapping=slot_mapping, positions=positions.to(device),
        causal=case.causal,
    )
    spec = FullAttentionSpec(block_size=bsz, num_kv_heads=hkv, head_size=d, dtype=case.dtype)
    builder = backend.get_builder_cls()(spec, ["layer.0"], torch.device(device))
    out = impl.forward(query, key, value, cache, builder.build(common))
    assert out.dtype == case.dtype and out.shape == query.shape

    expected = torch.cat([
        dense_attention(q, k, v, scale=scale, causal=case.causal, window=case.window,
                        slopes=slopes, cap=case.cap)
        for q, k, v in zip(qs, ks, vs, strict=True)
    ])
    got = out[: sum(case.qlen)].to(torch.float64).cpu()
    assert not torch.isnan(got).any(), "NaN leaked into real output rows"
    return float((got - expected).abs().max()), float(expected.abs().max())


CASES = {
    "decode": Case(ctx=[5, 8, 1, 13], qlen=[1, 1, 1, 1]),
    "prefill": Case(ctx=[0, 0, 0], qlen=[7, 4, 12]),
    "mixed": Case(ctx=[9, 3, 0, 0], qlen=[1, 1, 6, 11], pad=3),
    "chunked_prefill": Case(ctx=[8, 5, 11], qlen=[1, 7, 4], pad=2),
    "mqa": Case(ctx=[4, 0], qlen=[1, 9], hq=6, hkv=1),
    "gqa7": Case(ctx=[3, 6], qlen=[1, 5], hq=7, hkv=1, d=12),
    "no_gqa": Case(ctx=[2, 0], qlen=[1, 6], hq=3, hkv=3),
    "sliding_window": Case(ctx=[12, 9, 0], qlen=[1, 5, 10], window=5, pad=1),
    "window_1": Case(ctx=[4, 0], qlen=[1, 6], window=1),
    "alibi": Case(ctx=[7, 2], qlen=[1, 8], alibi=True),
    "soft_cap": Case(ctx=[6, 0], qlen=[1, 9], cap=0.7, d=16),
    "all_features": Case(ctx=[10, 6, 0], qlen=[1, 5, 9], window=6, alibi=True, cap=1.5,
                         block_size=3, pad=2),
    "block_size_1": Case(ctx=[4, 0], qlen=[1, 5], block_size=1),
    "odd_block_size": Case(ctx=[10, 4], qlen=[1, 9], block_size=7, d=20),
    "non_causal": Case(ctx=[0, 0], qlen=[5, 3], causal=False),
    "float16": Case(ctx=[9, 0], qlen=[1, 7], dtype=torch.float16, pad=1),
    "bfloat16": Case(ctx=[9, 0], qlen=[1, 7], dtype=torch.bfloat16, pad=1),
}

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_dense_oracle(name: str, seed: int) -> None:
    case = CASES[name]
    err, scale = run_case(case, seed)
    assert err / scale < TOL[case.dtype], f"{name}: relative error {err / scale:.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["mixed", "all_features", "bfloat16", "chunked_prefill"])
def test_reference_on_cuda(name: str) -> None:
    case = CASES[name]
    err, scale = run_case(case, 0, device="cuda")
    assert err / scale < TOL[case.dtype], f"{name}: relative error {err / scale:.2e}"


def test_oracle_is_not_trivially_satisfied() -> None:
    """The comparison can fail: a different window changes the answer noticeably."""
    q = torch.randn(4, 2, 8, dtype=torch.float64)
    k = torch.randn(6, 1, 8, dtype=torch.float64)
    v = torch.randn(6, 1, 8, dtype=torch.float64)
    a = dense_attention(q, k, v, scale=0.5, window=3)
    b = dense_attention(q, k, v, scale=0.5, window=4)
    assert (a - b).abs().max() > 1e-3


def test_padding_slots_are_skipped_and_nan_cache_is_harmless() -> None:
    impl = ReferenceBackend.get_impl_cls()(2, 4, 0.5, num_kv_heads=1)
    cache = torch.full(ReferenceBackend.get_kv_cache_shape(3, 2, 1, 4), float("nan"))
    key = torch.ones(3, 1, 4)
    impl.do_kv_cache_update(key, 2 * key, cache, torch.tensor([2, -1, 3]))
    flat_k = cache[0].reshape(-1, 1, 4)
    assert torch.equal(flat_k[2], key[0]) and torch.equal(flat_k[3], key[2])
    assert torch.isnan(flat_k[[0, 1, 4, 5]]).all(), "a -1 slot was written somewhere"


def test_bad_input_errors_are_clear() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        ReferenceBackend.get_impl_cls()(2, 4, 1.0, kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="num_blocks"):
        ReferenceBackend.get_kv_cache_shape(0, 16, 1, 4)
    impl = ReferenceBackend.get_impl_cls()(2, 4, 1.0)
    with pytest.raises(ValueError, match="reference layout"):
        impl.do_kv_cache_update(
            torch.ones(1, 2, 4), torch.ones(1, 2, 4), torch.zeros(3, 2, 4), torch.tensor([0])
        )


def test_large_group_is_split_and_still_correct() -> None:
    """Many decodes of long sequences exceed the per-group score budget and get chunked."""
    from pagedcore.reference import metadata

    old = metadata.MAX_GROUP_SCORES
    metadata.MAX_GROUP_SCORES = 20
    try:
        case = Case(ctx=[9, 5, 7, 3], qlen=[1, 1, 1, 1])
        err, scale = run_case(case, 3)
    finally:
        metadata.MAX_GROUP_SCORES = old
    assert err / scale < 1e-5


def test_builder_groups_decodes_together() -> None:
    qsl = torch.tensor([0, 1, 2, 7], dtype=torch.int32)
    seq = torch.tensor([4, 6, 5], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, seq_lens_cpu=seq,
        num_reqs=3, num_actual_tokens=7, max_query_len=5, max_seq_len=6,
        block_table=torch.tensor([[1, 2], [3, 4], [5, 6]], dtype=torch.int32),
        slot_mapping=torch.zeros(7, dtype=torch.int64), positions=torch.zeros(7, dtype=torch.int64),
    )
    spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=4, dtype="float32")
    md = ReferenceMetadataBuilder(spec, ["l"], torch.device("cpu")).build(common)
    assert [(g.num_reqs, g.query_len) for g in md.groups] == [(2, 1), (1, 5)]
    assert md.groups[0].slots.tolist() == [[4, 5, 6, 7, 0, 0], [12, 13, 14, 15, 16, 17]]


def test_long_prefill_is_cut_into_query_slices_and_still_correct() -> None:
    from pagedcore.reference import impl

    old = impl.MAX_SCORES_PER_CALL
    impl.MAX_SCORES_PER_CALL = 50  # forces slices of a few query rows
    try:
        equal_lens = Case(ctx=[3, 9, 0], qlen=[5, 5, 5], window=6)  # one group, sliced
        for case in (CASES["chunked_prefill"], CASES["all_features"], equal_lens):
            err, scale = run_case(case, 5)
            assert err / scale < 1e-5
    finally:
        impl.MAX_SCORES_PER_CALL = old


@st.composite
def _cases(draw: st.DrawFn) -> Case:
    n = draw(st.integers(1, 4))
    ctx = draw(st.lists(st.integers(0, 20), min_size=n, max_size=n))
    qlen = draw(st.lists(st.integers(1, 9), min_size=n, max_size=n))
    hkv = draw(st.integers(1, 3))
    return Case(
        ctx=ctx,
        qlen=qlen,
        block_size=draw(st.integers(1, 9)),
        hq=hkv * draw(st.integers(1, 4)),
        hkv=hkv,
        d=draw(st.sampled_from([4, 8, 12])),
        window=draw(st.none() | st.integers(1, 12)),
        alibi=draw(st.booleans()),
        cap=draw(st.none() | st.floats(0.5, 5.0)),
        pad=draw(st.integers(0, 3)),
    )


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_cases(), seed=st.integers(0, 2**16))
def test_reference_matches_dense_oracle_on_random_batches(case: Case, seed: int) -> None:
    err, scale = run_case(case, seed)
    assert err / scale < 1e-5, f"relative error {err / scale:.2e} on {case}"
