"""The descriptor: declarations, availability, registration through the entry point."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest
import torch
from pagedcore_triton import TritonAttentionBackend

from pagedcore.attention import AttentionConfig


def test_entry_point_registers_the_backend() -> None:
    eps = importlib.metadata.entry_points(group="pagedcore.backends")
    (ep,) = [e for e in eps if e.name == "triton"]
    module = ep.load()
    assert TritonAttentionBackend in list(module.pagedcore_register_backends())


def test_kv_cache_shape() -> None:
    assert TritonAttentionBackend.get_kv_cache_shape(10, 16, 8, 128) == (2, 10, 16, 8, 128)


def test_validate_configuration_lists_reasons() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ok = AttentionConfig(head_size=128, dtype="bfloat16", block_size=16, device=device)
    assert TritonAttentionBackend.validate_configuration(ok) == []
    bad = AttentionConfig(
        head_size=72, dtype="bfloat16", block_size=48, kv_cache_dtype="fp8_e4m3", use_mla=True,
        has_sink=True, device=device,
    )
    reasons = " | ".join(TritonAttentionBackend.validate_configuration(bad))
    for word in ("head size 72", "block size 48", "MLA"):
        assert word in reasons
    # fp8 caches and sinks are served (docs/conformance.md runs their cases).
    assert "kv_cache_dtype" not in reasons and "sink" not in reasons


def test_import_is_lazy_and_unavailable_without_gpu_says_why() -> None:
    code = (
        "import sys, os; os.environ.pop('TRITON_INTERPRET', None);"
        "import pagedcore_triton.plugin as p;"
        "assert 'triton' not in sys.modules, 'triton imported eagerly';"
        "B = p.TritonAttentionBackend; import torch;"
        "why = B.is_available();"
        "print(repr(why)); print(B.supported_devices)"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    if not torch.cuda.is_available():
        assert "CUDA" in res.stdout and "TRITON_INTERPRET=1" in res.stdout
        assert "('cuda',)" in res.stdout


def test_devices_follow_the_interpreter_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert TritonAttentionBackend.supported_devices == ("cuda", "cpu")
    assert TritonAttentionBackend.is_available() is None
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert TritonAttentionBackend.supported_devices == ("cuda",)
