"""The fp8 KV cache on CPU: the conformance suite's fp8 cases through `FakeOps` (the cache
write quantizes, decode / prefill read ``fp8 * scale``), and the routing to the fp8 ops."""

from __future__ import annotations

import attrs
import pytest
import torch
from fake_ops import FakeOps
from pagedcore_cuda_paged import CudaPagedBackend

from pagedcore.attention.backend import AttentionConfig
from pagedcore.conformance.cases import build_cases
from pagedcore.conformance.harness import run_case


@pytest.fixture
def cpu_backend(monkeypatch: pytest.MonkeyPatch) -> type[CudaPagedBackend]:
    """cuda_paged declared runnable on CPU (its kernels are `FakeOps` there)."""
    monkeypatch.setattr(CudaPagedBackend, "is_available", classmethod(lambda cls: None))
    monkeypatch.setattr(CudaPagedBackend, "supported_devices", ("cuda", "cpu"))
    return CudaPagedBackend


FP8_CASES = [c for c in build_cases(CudaPagedBackend, quick=True, device="cpu")
             if c.kv_cache_dtype != "auto"]


def test_fp8_cases_are_declared() -> None:
    kinds = {c.kv_cache_dtype for c in FP8_CASES}
    assert kinds == {"fp8_e4m3", "fp8_e5m2"}


@pytest.mark.parametrize("case", FP8_CASES, ids=lambda c: c.name)
def test_fp8_conformance_cases_through_fake_ops(
    fake_ops: FakeOps, cpu_backend: type[CudaPagedBackend], case: object,
) -> None:
    result = run_case(cpu_backend, case, device="cpu")  # type: ignore[arg-type]
    assert result.passed, result.message
    kinds = {c[0] for c in fake_ops.calls}
    assert "cache_write_fp8" in kinds and "cache_write" not in kinds
    assert not kinds & {"decode", "prefill"}  # never the model-dtype kernels on fp8 bytes


def test_fp8_case_fails_when_the_scale_is_dropped(
    fake_ops: FakeOps, cpu_backend: type[CudaPagedBackend], monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The check must be able to fail: reading the fp8 values without v_scale is caught.
    real = FakeOps._one

    def unscaled(self: FakeOps, *args: object) -> None:
        self.scales = (self.scales[0], torch.ones(1))
        real(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(FakeOps, "_one", unscaled)
    case = next(c for c in FP8_CASES if c.kv_cache_dtype == "fp8_e4m3")
    assert not run_case(cpu_backend, case, device="cpu").passed


def test_fp8_rejects_block_size_8() -> None:
    cfg = AttentionConfig(head_size=128, dtype="bfloat16", block_size=8, device="cuda",
                          kv_cache_dtype="fp8_e5m2")
    assert any("block size 16 or 32" in r for r in CudaPagedBackend.validate_configuration(cfg))
    with pytest.raises(ValueError, match="multiples of 16"):
        CudaPagedBackend.get_kv_cache_shape(4, 8, 2, 128, "fp8_e5m2")


@pytest.mark.parametrize(("dtype", "kernel"), [("float16", 1), ("float32", 0)])
def test_fp8_decode_routes_to_the_mma_kernel(
    fake_ops: FakeOps, cpu_backend: type[CudaPagedBackend], dtype: str, kernel: int,
) -> None:
    """fp16 / bf16 queries over an fp8 cache decode on the grouped tensor-core kernel
    (kernel 1, unroll 1 or 2); float32 queries on the per-head CUDA-core one (kernel 0)."""
    case = next(c for c in FP8_CASES if c.name.startswith("mixed/float16"))
    case = attrs.evolve(case, dtype=dtype)
    result = run_case(cpu_backend, case, device="cpu")
    assert result.passed, result.message
    decodes = [c for c in fake_ops.calls if c[0] == "decode_fp8"]
    assert decodes and {c[4] for c in decodes} == {kernel}
    assert {c[3] for c in decodes} == {kernel == 1}  # mma always groups the query heads
