"""Where the kernels run: a CUDA GPU, or Triton's interpreter on CPU tensors."""

from __future__ import annotations

import os

__all__ = ["interpreting"]


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET=1``: Triton runs kernels in its interpreter on CPU tensors.

    Triton reads the variable when a kernel is decorated, so it must be set before
    `pagedcore_triton.kernels` is first imported.
    """
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
