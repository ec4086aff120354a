"""The Triton MLA backend against the reference MLA (interpreter on CPU, native on a GPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
mla = pytest.importorskip("pagedcore_triton.mla")

from pagedcore.attention import AttentionConfig  # noqa: E402
from pagedcore.conformance.mla import (  # noqa: E402
    MLA_SPECS,
    MLABatchSpec,
    build_mla_case,
    run_mla_case,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("spec", MLA_SPECS, ids=lambda s: s.name)
def test_triton_mla_matches_reference(spec: MLABatchSpec) -> None:
    case = build_mla_case(spec, dtype=torch.float32, device=DEVICE, seed=1)
    result = run_mla_case(mla.TritonMLABackend, case, device=DEVICE)
    assert result.passed, result.detail


def test_split_kv_path_is_taken_and_correct() -> None:
    """Long contexts with few tokens split the context; the merged result still matches."""
    rule = mla.TritonMLAImpl.split_rule
    assert mla.choose_mla_splits(rule, num_tokens=2, head_blocks=1, max_seq_len=300) == 2
    assert mla.choose_mla_splits(rule, num_tokens=2, head_blocks=1, max_seq_len=100) == 1
    assert mla.choose_mla_splits(rule, num_tokens=1000, head_blocks=1, max_seq_len=9999) == 1
    spec = MLABatchSpec(name="split", query_lens=(1, 1, 3), seq_lens=(530, 200, 260),
                        block_size=16, num_heads=5, kv_lora_rank=32, rope_head_dim=16)
    case = build_mla_case(spec, dtype=torch.float32, device=DEVICE, seed=2)
    result = run_mla_case(mla.TritonMLABackend, case, device=DEVICE)
    assert result.passed, result.detail


def test_bfloat16_close_to_reference() -> None:
    spec = MLABatchSpec(name="bf16", query_lens=(1, 4), seq_lens=(40, 20), num_heads=16)
    case = build_mla_case(spec, dtype=torch.bfloat16, device=DEVICE, seed=3)
    result = run_mla_case(mla.TritonMLABackend, case, device=DEVICE)
    assert result.passed, result.detail


def test_declarations() -> None:
    cfg = AttentionConfig(head_size=576, dtype="bfloat16", block_size=16, use_mla=True,
                          device=DEVICE)
    assert mla.TritonMLABackend.validate_configuration(cfg) == []
    plain = AttentionConfig(head_size=128, dtype="bfloat16", block_size=16, device=DEVICE)
    assert "serves only MLA layers" in mla.TritonMLABackend.validate_configuration(plain)
    assert mla.TritonMLABackend.get_kv_cache_shape(7, 16, 1, 576) == (7, 16, 576)


def test_builder_plans_per_token_visible_lengths() -> None:
    """Each token of a mixed batch sees its context plus the step's tokens up to itself."""
    spec = MLABatchSpec(name="plan", query_lens=(1, 3, 2), seq_lens=(9, 5, 20))
    case = build_mla_case(spec, dtype=torch.float32)
    builder = mla.TritonMLAMetadataBuilder(None, [], torch.device("cpu"))  # type: ignore[arg-type]
    meta = builder.build(case.common)
    assert meta.token_req.tolist() == [0, 1, 1, 1, 2, 2]
    assert meta.token_kv_len.tolist() == [9, 3, 4, 5, 19, 20]
    assert meta.num_actual_tokens == 6 and meta.max_seq_len == 20
