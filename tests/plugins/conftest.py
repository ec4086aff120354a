from __future__ import annotations

from collections.abc import Iterator

import pytest

from pagedcore.plugins import registry as registry_module
from pagedcore.plugins.registry import BackendRegistry, isolated_registry
from pagedcore.plugins.selector import clear_selection_cache


@pytest.fixture(autouse=True)
def _clean_plugin_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test starts without env overrides, warned-once memory or cached selections."""
    monkeypatch.delenv("PAGEDCORE_PLUGINS", raising=False)
    monkeypatch.delenv("PAGEDCORE_BACKEND", raising=False)
    registry_module._WARNED.clear()
    clear_selection_cache()
    yield
    clear_selection_cache()


@pytest.fixture
def cuda_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend torch sees a CUDA device (selection checks it at call time)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend torch sees no CUDA device, even on a GPU machine."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def registry() -> Iterator[BackendRegistry]:
    """An empty registry installed as the process-wide one for the test."""
    with isolated_registry() as reg:
        yield reg
