"""Contract tests: the adapter's marshalling against a test double of flash_attn_varlen_func.

flash-attn is not importable here, so `flash_api.load_varlen_func` is replaced by one that
returns `VarlenDouble` (a pure-torch rendering of flash-attn's documented semantics). The
adapter's output is then compared with a dense float64 oracle in pagedcore's semantics over the
unpaged K/V; unused cache slots hold NaN.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from fa_paged_batch import PagedBatch, dense_oracle, make_batch, relative_error
from fa_varlen_double import VarlenDouble
from pagedcore_flash_attn import FlashAttnBackend, flash_api
from pagedcore_flash_attn.impl import FlashAttnImpl
from pagedcore_flash_attn.metadata import FlashAttnMetadata

from pagedcore.kv_cache.spec import FullAttentionSpec

HEAD = 64
TOL = 2e-2  # bf16 inputs and output; a marshalling error is O(1)


@pytest.fixture
def double(monkeypatch: pytest.MonkeyPatch) -> VarlenDouble:
    fake = VarlenDouble()
    monkeypatch.setattr(flash_api, "load_varlen_func", lambda: fake)
    return fake


def build(batch: PagedBatch, num_kv_heads: int, block_size: int = 256) -> FlashAttnMetadata:
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=num_kv_heads, head_size=HEAD, dtype="bfloat16"
    )
    builder = FlashAttnBackend.get_builder_cls()(spec, ["layer.0"], torch.device("cpu"))
    metadata = builder.build(batch.common)
    assert isinstance(metadata, FlashAttnMetadata)
    return metadata


def run(
    batch: PagedBatch, impl: FlashAttnImpl, *, output: torch.Tensor | None = None
) -> torch.Tensor:
    metadata = build(batch, impl.num_kv_heads)
    impl.do_kv_cache_update(batch.key, batch.value, batch.kv_cache, batch.common.slot_mapping)
    return impl.forward(
        batch.query, batch.key, batch.value, batch.kv_cache, metadata, output=output
    )


# (context_len, query_len) per request.
DECODE = [(300, 1), (17, 1), (511, 1), (700, 1)]
PREFILL = [(0, 40), (0, 300), (0, 5)]
MIXED_CHUNKED = [(260, 1), (0, 513), (300, 90), (511, 2), (256, 256)]


@pytest.mark.parametrize(
    ("requests", "num_heads", "num_kv_heads"),
    [
        (DECODE, 8, 2),
        (DECODE, 7, 1),
        (PREFILL, 4, 4),
        (MIXED_CHUNKED, 8, 1),
        (MIXED_CHUNKED, 7, 7),
    ],
    ids=["decode-gqa4", "decode-mqa7", "prefill-mha", "mixed-chunked-mqa8", "mixed-chunked-mha"],
)
def test_forward_matches_dense_oracle(
    double: VarlenDouble, requests: list[tuple[int, int]], num_heads: int, num_kv_heads: int
) -> None:
    batch = make_batch(requests, num_heads=num_heads, num_kv_heads=num_kv_heads, seed=1)
    impl = FlashAttnImpl(num_heads, HEAD, HEAD**-0.5, num_kv_heads=num_kv_heads)
    out = run(batch, impl)
    err = relative_error(out, dense_oracle(batch, scale=HEAD**-0.5))
    assert err < TOL, f"relative error {err:.3g} vs dense float64 oracle"
    call = double.calls[-1]
    assert call["causal"] is True and call["window_size"] == (-1, -1)
    assert call["softcap"] == 0.0 and call["alibi_slopes"] is None
    assert call["k"].data_ptr() == batch.kv_cache[0].data_ptr()  # no copy of the cache
    assert call["v"].data_ptr() == batch.kv_cache[1].data_ptr()
    assert call["max_seqlen_q"] == max(q for _, q in requests)
    assert call["max_seqlen_k"] == max(c + q for c, q in requests)
    expected_cu_k = torch.tensor([0, *torch.tensor([c + q for c, q in requests]).cumsum(0)])
    assert torch.equal(call["cu_seqlens_k"].long(), expected_cu_k)


@pytest.mark.parametrize("window", [1, 37, 256, 300])
def test_sliding_window_is_w_minus_one_left(double: VarlenDouble, window: int) -> None:
    batch = make_batch(MIXED_CHUNKED, num_heads=4, num_kv_heads=2, seed=2)
    impl = FlashAttnImpl(4, HEAD, 0.2, num_kv_heads=2, sliding_window=window)
    out = run(batch, impl)
    err = relative_error(out, dense_oracle(batch, scale=0.2, sliding_window=window))
    assert err < TOL, f"window {window}: relative error {err:.3g}"
    assert double.calls[-1]["window_size"] == (window - 1, 0)


def test_alibi_and_softcap_together(double: VarlenDouble) -> None:
    slopes = [2.0 ** (-(h + 1)) for h in range(8)]
    batch = make_batch(MIXED_CHUNKED, num_heads=8, num_kv_heads=2, seed=3)
    impl = FlashAttnImpl(8, HEAD, 0.5, num_kv_heads=2, alibi_slopes=slopes, logits_soft_cap=5.0)
    out = run(batch, impl)
    expected = dense_oracle(batch, scale=0.5, alibi_slopes=slopes, soft_cap=5.0)
    err = relative_error(out, expected)
    assert err < TOL, f"relative error {err:.3g}"
    call = double.calls[-1]
    assert call["softcap"] == 5.0
    assert call["alibi_slopes"].dtype == torch.float32
    assert call["alibi_slopes"].tolist() == slopes


@pytest.mark.parametrize("soft_cap", [None, 3.0])
def test_alibi_window_softcap_decode(double: VarlenDouble, soft_cap: float | None) -> None:
    slopes = [0.05 * (h + 1) for h in range(4)]
    batch = make_batch(DECODE, num_heads=4, num_kv_heads=4, seed=4)
    impl = FlashAttnImpl(
        4, HEAD, 0.3, alibi_slopes=slopes, sliding_window=100, logits_soft_cap=soft_cap
    )
    out = run(batch, impl)
    expected = dense_oracle(
        batch, scale=0.3, alibi_slopes=slopes, sliding_window=100, soft_cap=soft_cap
    )
    err = relative_error(out, expected)
    assert err < TOL, f"relative error {err:.3g}"


def test_padding_tokens_and_output_buffer(double: VarlenDouble) -> None:
    batch = make_batch(MIXED_CHUNKED, num_heads=4, num_kv_heads=2, pad_tokens=5, seed=5)
    impl = FlashAttnImpl(4, HEAD, 0.125, num_kv_heads=2)
    output = torch.full_like(batch.query, 7.0)
    out = run(batch, impl, output=output)
    assert out is output
    n = batch.common.num_actual_tokens
    err = relative_error(out[:n], dense_oracle(batch, scale=0.125))
    assert err < TOL, f"relative error {err:.3g}"
    assert bool((out[n:] == 7.0).all()), "padding rows of the output buffer were written"
    assert double.calls[-1]["q"].shape[0] == n  # padding rows are not passed to flash-attn


def test_cache_write_skips_padding_slots() -> None:
    batch = make_batch(MIXED_CHUNKED, num_heads=2, num_kv_heads=2, pad_tokens=4, seed=6)
    impl = FlashAttnImpl(2, HEAD, 0.1)
    before_nan = int(batch.kv_cache.isnan().any(-1).any(-1).sum())
    impl.do_kv_cache_update(batch.key, batch.value, batch.kv_cache, batch.common.slot_mapping)
    written = int((batch.common.slot_mapping >= 0).sum())
    after_nan = int(batch.kv_cache.isnan().any(-1).any(-1).sum())
    assert before_nan - after_nan == 2 * written  # K and V, one slot per real token
    flat = batch.kv_cache.view(2, -1, 2, HEAD)
    for r, (ctx, q_len) in enumerate(zip(batch.context_lens, batch.query_lens, strict=True)):
        table = batch.common.block_table[r]
        for pos in (ctx, ctx + q_len - 1):
            slot = int(table[pos // 256]) * 256 + pos % 256
            assert torch.equal(flat[0, slot], batch.full_k[r][pos])
            assert torch.equal(flat[1, slot], batch.full_v[r][pos])
    assert bool(batch.kv_cache[:, 0].isnan().all()), "the null block was written"


def test_non_causal_alibi_is_refused(double: VarlenDouble) -> None:
    batch = make_batch(PREFILL, num_heads=2, num_kv_heads=2, seed=7)
    impl = FlashAttnImpl(2, HEAD, 0.1, alibi_slopes=[0.1, 0.2])
    metadata = build(batch, 2)

    metadata = attrs.evolve(metadata, causal=False)
    with pytest.raises(ValueError, match="ALiBi only for causal"):
        impl.forward(batch.query, batch.key, batch.value, batch.kv_cache, metadata)


def test_builder_rejects_a_too_narrow_block_table() -> None:
    batch = make_batch([(600, 1)], num_heads=2, num_kv_heads=2, extra_table_columns=0)

    common = attrs.evolve(batch.common, block_table=batch.common.block_table[:, :2])
    spec = FullAttentionSpec(block_size=256, num_kv_heads=2, head_size=HEAD, dtype="bfloat16")
    builder = FlashAttnBackend.get_builder_cls()(spec, ["l"], torch.device("cpu"))
    with pytest.raises(ValueError, match="max_seq_len is 601"):
        builder.build(common)


# --- The harness must catch a wrong adapter. Each mutant breaks one piece of marshalling. ---


def test_harness_catches_top_left_causal(monkeypatch: pytest.MonkeyPatch) -> None:
    wrong = VarlenDouble(causal_top_left=True)
    monkeypatch.setattr(flash_api, "load_varlen_func", lambda: wrong)
    batch = make_batch(MIXED_CHUNKED, num_heads=2, num_kv_heads=1, seed=8)
    out = run(batch, FlashAttnImpl(2, HEAD, 0.125, num_kv_heads=1))
    assert not relative_error(out, dense_oracle(batch, scale=0.125)) < TOL


def test_harness_catches_off_by_one_window(double: VarlenDouble) -> None:
    batch = make_batch(MIXED_CHUNKED, num_heads=2, num_kv_heads=1, seed=9)
    impl = FlashAttnImpl(2, HEAD, 0.125, num_kv_heads=1, sliding_window=37)
    impl.window_size = (37, 0)  # the classic mistake: W instead of W - 1
    out = run(batch, impl)
    assert not relative_error(out, dense_oracle(batch, scale=0.125, sliding_window=37)) < TOL


def test_harness_catches_ignored_block_table(double: VarlenDouble) -> None:
    batch = make_batch(DECODE, num_heads=2, num_kv_heads=2, seed=10)
    metadata = build(batch, 2)

    identity = torch.arange(metadata.block_table.numel(), dtype=torch.int32) + 1
    identity = identity.remainder(batch.kv_cache.shape[1]).view_as(metadata.block_table)
    metadata = attrs.evolve(metadata, block_table=identity.contiguous())
    impl = FlashAttnImpl(2, HEAD, 0.125)
    impl.do_kv_cache_update(batch.key, batch.value, batch.kv_cache, batch.common.slot_mapping)
    out = impl.forward(batch.query, batch.key, batch.value, batch.kv_cache, metadata)
    assert not relative_error(out, dense_oracle(batch, scale=0.125)) < TOL


def test_double_enforces_flash_attn_checks(double: VarlenDouble) -> None:
    batch = make_batch(DECODE, num_heads=2, num_kv_heads=2, block_size=256, seed=11)
    metadata = build(batch, 2)
    impl = FlashAttnImpl(2, HEAD, 0.125)
    small = batch.kv_cache[:, :, :128].contiguous()
    with pytest.raises(RuntimeError, match="divisible by 256"):
        impl.forward(batch.query, batch.key, batch.value, small, metadata)
