"""What `pagedcore backends` says when FlashInfer is missing, too old or broken; what
`validate_configuration` rejects; the cheap plugin import; the cache layout and write."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from pagedcore_flashinfer import FlashInferBackend, capabilities, fi_api
from pagedcore_flashinfer.impl import FlashInferImpl

from pagedcore import AttentionConfig


def test_plugin_import_is_cheap() -> None:
    code = (
        "import sys, pagedcore_flashinfer.plugin as p; p.pagedcore_register_backends(); "
        "print('flashinfer' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_missing_flashinfer_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(capabilities, "installed_version", lambda: None)
    why = FlashInferBackend.is_available()
    assert why is not None and "not installed" in why and "flashinfer-python" in why


@pytest.mark.parametrize(
    ("version", "expected"),
    [("0.6.1", "too old"), ("0.2.0.post2", "too old"), ("0.7.2.post1", None), ("1.0", None)],
)
def test_version_gate(version: str, expected: str | None) -> None:
    why = capabilities.version_problem(version)
    assert (why is None) if expected is None else (why is not None and expected in why)


def test_no_gpu_and_old_gpu() -> None:
    no_gpu = capabilities.capability_problem(None)
    assert no_gpu is not None and "CUDA" in no_gpu
    old = capabilities.capability_problem((7, 5))
    assert old is not None and "7.5" in old
    assert capabilities.capability_problem((9, 0)) is None


def test_import_failure_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # `import flashinfer` raises
    monkeypatch.setattr(capabilities, "installed_version", lambda: "0.7.2")
    monkeypatch.setattr(capabilities, "device_capability", lambda: (9, 0))
    try:
        with pytest.raises(RuntimeError, match="failed to import"):
            fi_api.load_flashinfer()
        why = FlashInferBackend.is_available()
        assert why is not None and "failed to import" in why
    finally:
        capabilities.record_load_failure(None)


def test_validate_configuration_gives_reasons() -> None:
    cfg = AttentionConfig(
        head_size=96, dtype="float32", block_size=24, device="cuda", use_alibi=True
    )
    reasons = " | ".join(FlashInferBackend.validate_configuration(cfg))
    for part in ("head size 96", "dtype float32", "block size 24", "ALiBi"):
        assert part in reasons, reasons
    with pytest.raises(ValueError, match="ALiBi"):
        FlashInferImpl(4, 64, 0.125, num_kv_heads=2, alibi_slopes=[0.5] * 4)
    with pytest.raises(ValueError, match="head size 80"):
        FlashInferImpl(4, 80, 0.125, num_kv_heads=2)


def test_cache_layout_and_write_skip_padding() -> None:
    shape = FlashInferBackend.get_kv_cache_shape(6, 4, 2, 64)
    assert shape == (6, 2, 4, 2, 64)
    cache = torch.full(shape, float("nan"), dtype=torch.float16)
    impl = FlashInferImpl(4, 64, 0.125, num_kv_heads=2)
    key = torch.randn(3, 2, 64, dtype=torch.float16)
    value = torch.randn(3, 2, 64, dtype=torch.float16)
    impl.do_kv_cache_update(key, value, cache, torch.tensor([9, -1, 20]))
    assert torch.equal(cache[2, 0, 1], key[0]) and torch.equal(cache[2, 1, 1], value[0])
    assert torch.equal(cache[5, 0, 0], key[2]) and torch.equal(cache[5, 1, 0], value[2])
    assert int((~cache.isnan()).sum()) == 4 * 2 * 64  # nothing else written
    with pytest.raises(ValueError, match="NHD"):
        impl.do_kv_cache_update(key, value, cache.transpose(0, 1).contiguous(), torch.arange(3))


def test_cache_write_has_no_data_dependent_shapes() -> None:
    """The write must be capturable in a CUDA graph (the H200 run, session 11: a boolean-mask
    write made every decode-graph capture fail with cudaErrorStreamCaptureInvalidated). On
    the meta device an op whose output shape depends on the data (``nonzero``, hence boolean
    indexing) cannot run, so the write running there is the CPU check of that."""
    impl = FlashInferImpl(4, 64, 0.125, num_kv_heads=2)
    cache = torch.empty(FlashInferBackend.get_kv_cache_shape(6, 4, 2, 64), device="meta",
                        dtype=torch.float16)
    key = torch.empty(5, 2, 64, device="meta", dtype=torch.float16)
    impl.do_kv_cache_update(key, key, cache, torch.empty(5, dtype=torch.int64, device="meta"))
    with pytest.raises(NotImplementedError):  # what the old write did, for contrast
        key[torch.empty(5, dtype=torch.bool, device="meta")]


def test_padding_rows_leave_the_null_block_as_it_was() -> None:
    cache = torch.randn(FlashInferBackend.get_kv_cache_shape(4, 4, 2, 64), dtype=torch.float16)
    before = cache.clone()
    impl = FlashInferImpl(4, 64, 0.125, num_kv_heads=2)
    key = torch.randn(4, 2, 64, dtype=torch.float16)
    impl.do_kv_cache_update(key, -key, cache, torch.tensor([-1, 5, -1, -1]))
    assert torch.equal(cache[1, 0, 1], key[1]) and torch.equal(cache[1, 1, 1], -key[1])
    cache[1, :, 1] = before[1, :, 1]
    assert torch.equal(cache, before)
