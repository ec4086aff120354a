"""Shared fixtures of the cuda_paged CPU tests."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "bench"))

from fake_ops import FakeOps  # noqa: E402


@pytest.fixture
def fake_ops(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeOps]:
    """Route the impl's kernel calls to `FakeOps` (torch on CPU)."""
    import pagedcore_cuda_paged.impl as impl

    ops = FakeOps()
    monkeypatch.setattr(impl, "load_ops", lambda: ops)
    monkeypatch.setattr(impl, "_smem_limit", lambda device: 227 * 1024)
    yield ops
