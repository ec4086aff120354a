"""Fixtures of the engine tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from engine_helpers import ARCHS


@pytest.fixture(params=ARCHS)
def arch(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny models run far faster on one intra-op thread (and do not fight parallel jobs)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
