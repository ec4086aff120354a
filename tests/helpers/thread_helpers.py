"""One torch intra-op thread for a test session (tiny models run far faster so, and do not
fight parallel jobs for the cores)."""

from __future__ import annotations

from collections.abc import Iterator

import torch


def one_thread() -> Iterator[None]:
    """A session fixture body: ``pytest.fixture(scope="session", autouse=True)(one_thread)``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
