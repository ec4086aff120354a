"""The reference MLA against dense multi-head attention over decompressed K/V."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch

from pagedcore.attention import AttentionConfig
from pagedcore.conformance.mla import (
    MLA_SPECS,
    MLABatchSpec,
    build_mla_case,
    run_mla_case,
    run_mla_suite,
)
from pagedcore.reference.mla import (
    MLAImpl,
    ReferenceMLABackend,
    ReferenceMLAMetadata,
)


def _dense_mha(
    c: torch.Tensor, k_pe: torch.Tensor, q_nope: torch.Tensor, q_pe: torch.Tensor,
    w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float, q_len: int,
) -> torch.Tensor:
    """Decompressed attention for one request: c [S, L], k_pe [S, R], q_* [q_len, H, *]."""
    k_nope = torch.einsum("sl,hnl->hsn", c, w_uk)  # [H, S, nope]
    v = torch.einsum("sl,hvl->hsv", c, w_uv)  # [H, S, v]
    seq = c.shape[0]
    k = torch.cat([k_nope, k_pe[None].expand(k_nope.shape[0], -1, -1)], dim=-1)
    q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)  # [H, q_len, nope + R]
    s = q @ k.transpose(1, 2) * scale
    qpos = torch.arange(seq - q_len, seq)[:, None]
    s = s.masked_fill(torch.arange(seq)[None] > qpos, float("-inf"))
    return (s.softmax(-1) @ v).transpose(0, 1)  # [q_len, H, v]


def test_absorbed_reference_equals_decompressed_attention() -> None:
    """Absorbed latent attention through the paged cache == dense MHA on decompressed K/V."""
    spec = MLABatchSpec(name="t", query_lens=(1, 5, 9), seq_lens=(11, 20, 9), block_size=4,
                        num_heads=3, kv_lora_rank=24, rope_head_dim=8)
    case = build_mla_case(spec, dtype=torch.float64, seed=3)
    gen = torch.Generator().manual_seed(7)
    nope, vdim, lat = 12, 10, spec.kv_lora_rank
    w_uk = torch.randn(spec.num_heads, nope, lat, generator=gen, dtype=torch.float64)
    w_uv = torch.randn(spec.num_heads, vdim, lat, generator=gen, dtype=torch.float64)
    scale = (nope + spec.rope_head_dim) ** -0.5
    # Build full sequences; history rows go into the cache, new rows through the impl.
    impl = MLAImpl(spec.num_heads, lat + spec.rope_head_dim, scale, kv_lora_rank=lat)
    common = case.common
    bs = spec.block_size
    cache = case.kv_cache.clone()
    seqs: list[torch.Tensor] = []
    for r, s in enumerate(spec.seq_lens):
        rows = torch.randn(s, lat + spec.rope_head_dim, generator=gen, dtype=torch.float64)
        seqs.append(rows)
        for pos in range(s - spec.query_lens[r]):
            cache[int(common.block_table[r, pos // bs]), pos % bs] = rows[pos]
    key = torch.cat([rows[s - q :] for rows, q, s in
                     zip(seqs, spec.query_lens, spec.seq_lens, strict=True)])[:, None]
    total = sum(spec.query_lens)
    q_nope = torch.randn(total, spec.num_heads, nope, generator=gen, dtype=torch.float64)
    q_pe = torch.randn(total, spec.num_heads, spec.rope_head_dim, generator=gen,
                       dtype=torch.float64)
    query = torch.cat([torch.einsum("thn,hnl->thl", q_nope, w_uk), q_pe], dim=-1)
    slot_mapping = common.slot_mapping[:total]
    impl.do_kv_cache_update(key, key, cache, slot_mapping)
    meta = ReferenceMLABackend.get_builder_cls()(
        None, [], torch.device("cpu")  # type: ignore[arg-type]
    ).build(common)
    assert isinstance(meta, ReferenceMLAMetadata)
    latent = impl.forward(query, key, key, cache, meta)
    got = torch.einsum("thl,hvl->thv", latent[:total], w_uv)
    start = 0
    for r, (q, rows) in enumerate(zip(spec.query_lens, seqs, strict=True)):
        want = _dense_mha(rows[:, :lat], rows[:, lat:], q_nope[start : start + q],
                          q_pe[start : start + q], w_uk, w_uv, scale, q)
        torch.testing.assert_close(got[start : start + q], want, rtol=1e-9, atol=1e-9,
                                   msg=f"request {r}")
        start += q


@pytest.mark.parametrize("spec", MLA_SPECS, ids=lambda s: s.name)
def test_reference_mla_suite_float32(spec: MLABatchSpec) -> None:
    """The float32 reference agrees with its float64 self on every named spec."""
    case = build_mla_case(spec, dtype=torch.float32)
    result = run_mla_case(ReferenceMLABackend, case)
    assert result.passed, result.detail
    assert result.rel_err is not None and result.rel_err < 1e-5


def test_suite_catches_backend_that_ignores_block_table() -> None:
    """A backend reading logical blocks as physical ones must fail the MLA suite."""

    class IgnoresTable(MLAImpl):
        def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    kv_cache: torch.Tensor, metadata: ReferenceMLAMetadata, *,
                    output: torch.Tensor | None = None) -> torch.Tensor:
            common = metadata.common
            ident = torch.arange(common.block_table.shape[1], dtype=torch.int32) + 1
            broken = common.block_table.clone()
            broken[:] = ident
            import attrs

            bad = attrs.evolve(metadata, common=attrs.evolve(common, block_table=broken))
            return super().forward(query, key, value, kv_cache, bad, output=output)

    class Broken(ReferenceMLABackend):
        name = "broken_mla"

        @classmethod
        def get_impl_cls(cls) -> Any:
            return IgnoresTable

    results = run_mla_suite(Broken)
    assert results and not any(r.passed for r in results if r.spec != "block1_odd_dims")


def test_selection_flags() -> None:
    """MLA-only: rejects non-MLA configs with a reason, accepts MLA ones on CPU and CUDA."""
    mla = AttentionConfig(head_size=576, dtype="bfloat16", block_size=16, use_mla=True)
    plain = AttentionConfig(head_size=128, dtype="bfloat16", block_size=16)
    assert ReferenceMLABackend.validate_configuration(mla) == []
    assert "serves only MLA layers" in ReferenceMLABackend.validate_configuration(plain)
    assert ReferenceMLABackend.get_kv_cache_shape(10, 16, 1, 576) == (10, 16, 576)
    with pytest.raises(ValueError, match="one latent head"):
        ReferenceMLABackend.get_kv_cache_shape(10, 16, 2, 576)


def test_bad_inputs_have_clear_errors() -> None:
    with pytest.raises(ValueError, match="kv_lora_rank"):
        MLAImpl(4, 80, 0.1)
    with pytest.raises(ValueError, match=r"\[T, 1, L \+ R\]"):
        MLAImpl(4, 80, 0.1, kv_lora_rank=64).do_kv_cache_update(
            torch.zeros(3, 2, 80), torch.zeros(3, 2, 80), torch.zeros(4, 16, 80),
            torch.zeros(3, dtype=torch.int64))


def test_needles_catch_one_misread_position_in_16_bit_tolerances() -> None:
    """An off-by-one read of one position (the row of position p + 1 taken for p) moves the
    output of the `needles` spec far past the bf16 tolerance when p is a needle, and stays
    within it when p is an ordinary row of the same spec (what the random specs alone could
    not catch in 16-bit dtypes)."""
    from pagedcore.conformance.mla import TOLERANCE, _run

    spec = next(s for s in MLA_SPECS if s.name == "needles")
    assert {0, 31, 128, 256} <= set(spec.needles) and not {5, 200} & set(spec.needles)
    case = build_mla_case(spec, dtype=torch.float32)
    dev = torch.device("cpu")
    want = _run(ReferenceMLABackend, case, dev)
    table = case.common.block_table

    def misread(pos: int) -> float:
        cache = case.kv_cache.clone()
        bs = spec.block_size
        slot = lambda p: (int(table[0, p // bs]), p % bs)  # noqa: E731
        cache[slot(pos)] = cache[slot(pos + 1)]
        got = _run(ReferenceMLABackend, attrs.evolve(case, kv_cache=cache), dev)
        return float((got - want).norm() / want.norm())

    for needle in (0, 31, 128, 256):  # a block edge, tile edges, split edges
        assert misread(needle) > 1.5 * TOLERANCE["bfloat16"], needle
    for ordinary in (5, 200):
        assert misread(ordinary) < 0.1 * TOLERANCE["bfloat16"], ordinary


def test_mla_cases_run_at_the_widths_a_backend_declares() -> None:
    """A backend that serves only 128/64 gets every spec at 128/64 (named so), not the
    fixed 64/16 and 48/8 it would refuse; a backend declaring any width keeps the specs."""

    class Only128x64(MLAImpl):
        def check_supported(self) -> None:
            super().check_supported()
            if (self.kv_lora_rank, self.head_size - self.kv_lora_rank) != (128, 64):
                raise ValueError("serves kv_lora_rank 128 with rope_head_dim 64 only")

    class Wide(ReferenceMLABackend):
        name = "wide_mla"
        supported_mla_dims = ((128, 64),)

        @classmethod
        def get_impl_cls(cls) -> Any:
            return Only128x64

    specs = [s for s in MLA_SPECS if s.name in ("decode", "block1_odd_dims")]
    results = run_mla_suite(Wide, specs=specs)
    auto = [r for r in results if r.kv_cache_dtype == "auto"]
    assert [r.spec for r in auto] == ["decode/L128R64", "block1_odd_dims/L128R64"]
    # The fp8 cases (the decode spec, per declared fp8 dtype) run at the claimed widths too.
    assert {r.spec for r in results if r.kv_cache_dtype != "auto"} == {"decode/L128R64"}
    assert all(r.passed for r in results), [r.detail for r in results]
    plain = run_mla_suite(ReferenceMLABackend, specs=specs)
    assert [r.spec for r in plain if r.kv_cache_dtype == "auto"] == ["decode", "block1_odd_dims"]


def test_a_bad_mla_widths_declaration_is_reported() -> None:
    from pagedcore.plugins.validation import declaration_problems

    class Bad(ReferenceMLABackend):
        name = "bad_dims"
        supported_mla_dims = (512, 64)  # type: ignore[assignment]

    problems = declaration_problems(Bad)
    assert any("supported_mla_dims" in p and "pairs" in p for p in problems), problems
    assert declaration_problems(ReferenceMLABackend) == []
