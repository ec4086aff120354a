"""The flashinfer_mla backend: the MLA conformance suite through the adapter and the FlashInfer
TEST DOUBLE (CPU), at the widths the backend declares; on real FlashInfer where available."""

from __future__ import annotations

from typing import ClassVar

import fi_double
import pytest
import torch
from pagedcore_flashinfer import FlashInferMLABackend, fi_api
from pagedcore_flashinfer.mla import FlashInferMLAImpl

from pagedcore import AttentionConfig
from pagedcore.conformance import run_suite
from pagedcore.conformance.mla import MLA_SPECS, run_mla_suite


class _CpuDoubleMLA(FlashInferMLABackend):
    name: ClassVar[str] = "flashinfer_mla_test_double"
    supported_devices: ClassVar[tuple[str, ...]] = ("cpu",)

    @classmethod
    def is_available(cls) -> str | None:
        return None


@pytest.fixture()
def double(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fi_api, "load_flashinfer_mla", lambda: fi_double.FakeFlashInferMLA())
    fi_double.REGISTRY.clear()


def test_full_mla_suite_on_real_flashinfer() -> None:
    why = FlashInferMLABackend.is_available()
    if why is not None:
        pytest.skip(f"flashinfer_mla unavailable here: {why}")
    report = run_suite("flashinfer_mla", quick=False)
    assert report.passed, report.summary()


@pytest.mark.usefixtures("double")
def test_mla_suite_through_the_double_at_the_declared_widths() -> None:
    results = run_mla_suite(_CpuDoubleMLA, device="cpu")
    assert len(results) == len(MLA_SPECS)
    assert all(r.passed for r in results), [(r.spec, r.rel_err, r.detail) for r in results]
    # The suite's 64/16 and 48/8 specs ran at 512/64, named so; block size 8 became 16.
    names = {r.spec for r in results}
    assert "decode/L512R64" in names and "block1_odd_dims/L512R64" in names, names
    assert {r.block_size for r in results} <= {1, 16, 32, 64}
    plans = [p for w in fi_double.REGISTRY for p in w.plans]
    assert plans and {(p["ckv"], p["kpe"]) for p in plans} == {(512, 64)}
    assert all(p["causal"] for p in plans)
    assert {w.backend for w in fi_double.REGISTRY} == {"fa2"}


@pytest.mark.usefixtures("double")
def test_the_suite_catches_a_planning_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages handed to FlashInfer in the wrong order fail every multi-page spec."""
    from pagedcore_flashinfer import mla

    real = mla.paged_kv

    def reversed_pages(*args: object) -> object:
        pages = real(*args)  # type: ignore[arg-type]
        import attrs

        return attrs.evolve(pages, indices=pages.indices.flip(0))

    monkeypatch.setattr(mla, "paged_kv", reversed_pages)
    results = run_mla_suite(_CpuDoubleMLA, device="cpu")
    failed = {r.spec for r in results if not r.passed}
    assert {"decode/L512R64", "needles/L512R64", "decode_long/L512R64"} <= failed, failed


def test_declarations_and_clear_errors() -> None:
    cfg = AttentionConfig(head_size=576, dtype="bfloat16", block_size=16, use_mla=True,
                          device="cuda")
    reasons = FlashInferMLABackend.validate_configuration(cfg)
    assert not [r for r in reasons if not r.startswith("not available")], reasons
    other = AttentionConfig(head_size=80, dtype="bfloat16", block_size=16, use_mla=True,
                            device="cuda")
    assert any("head size 80" in r for r in FlashInferMLABackend.validate_configuration(other))
    with pytest.raises(ValueError, match=r"kv_lora_rank 448 with rope_head_dim 128"):
        FlashInferMLAImpl(16, 576, 0.1, kv_lora_rank=448)
    with pytest.raises(ValueError, match="neither ALiBi, sliding window nor soft-cap"):
        FlashInferMLAImpl(16, 576, 0.1, kv_lora_rank=512, sliding_window=8)
    impl = FlashInferMLAImpl(16, 576, 0.1, kv_lora_rank=512)
    with pytest.raises(ValueError, match=r"\[num_blocks, block_size, 576\]"):
        impl.forward(torch.zeros(1, 16, 576), torch.zeros(1), torch.zeros(1),
                     torch.zeros(4, 16, 512), None)  # type: ignore[arg-type]


@pytest.mark.usefixtures("double")
def test_bench_mla_side_by_side_runs_the_adapter() -> None:
    """`pagedcore bench mla --backend flashinfer_mla`'s rows come from the adapter's builder
    and impl (here over the double): the reference's output, and a refused step is a row
    with the adapter's error, not a crash of the bench."""
    from pagedcore.bench.mla_backends import backend_rows

    (row,) = backend_rows(torch.device("cpu"), [_CpuDoubleMLA], quick=True, copy_gbps=None,
                          dtype=torch.bfloat16)
    assert "error" not in row, row
    assert row["rel_err"] < 1e-2 and row["ms"] > 0 and row["best_for_shape"]
    plans = [p for w in fi_double.REGISTRY for p in w.plans]
    assert {(p["ckv"], p["kpe"]) for p in plans} == {(512, 64)}
    (bad,) = backend_rows(torch.device("cpu"), [_CpuDoubleMLA], quick=True, copy_gbps=None)
    assert "q dtype must be fp16/bf16" in bad["error"] and "triton_mla" in bad["error"]
