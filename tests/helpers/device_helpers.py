"""The device tests that can run on either run on: ``PAGEDCORE_TEST_DEVICE`` (default "cpu";
"cuda" on a GPU machine, e.g. ``PAGEDCORE_TEST_DEVICE=cuda pytest tests/text/...``)."""

from __future__ import annotations

import os

import pytest

#: "cpu" unless ``PAGEDCORE_TEST_DEVICE`` says otherwise.
TEST_DEVICE = os.environ.get("PAGEDCORE_TEST_DEVICE", "cpu")
#: The attention backend of engines on `TEST_DEVICE`: ``PAGEDCORE_TEST_BACKEND`` if set, else the
#: reference on the CPU and the selector's choice elsewhere.
TEST_BACKEND = os.environ.get("PAGEDCORE_TEST_BACKEND") or (
    "reference" if TEST_DEVICE == "cpu" else None)


def require_test_device() -> None:
    """Skip when `TEST_DEVICE` is CUDA and no GPU is present."""
    if TEST_DEVICE.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            pytest.skip(f"PAGEDCORE_TEST_DEVICE={TEST_DEVICE} but CUDA is not available")
