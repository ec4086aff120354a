"""Where the kernels run: a CUDA GPU, or Triton's interpreter on CPU tensors."""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_NUM_SMS", "interpreting", "num_sms", "triton_unavailable_reason"]

#: SMs assumed off CUDA (the interpreter): the H100's and H200's 132, so plans sized by the
#: SM count come out there as on those GPUs.
DEFAULT_NUM_SMS = 132


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET=1``: Triton runs kernels in its interpreter on CPU tensors.

    Triton reads the variable when a kernel is decorated, so it must be set before
    `pagedcore_triton.kernels` is first imported.
    """
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=8)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (`DEFAULT_NUM_SMS` off CUDA)."""
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    import torch

    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def triton_unavailable_reason() -> str | None:
    """None when the Triton kernels can run here, else why not (shared by every descriptor)."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install triton)"
    if interpreting():
        return None
    import torch

    if not torch.cuda.is_available():
        return (
            "needs a CUDA GPU (torch.cuda.is_available() is False); set TRITON_INTERPRET=1 "
            "before importing pagedcore_triton to run it on CPU tensors in Triton's "
            "interpreter (slow, for tests)"
        )
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        return f"needs compute capability >= 8.0 (found {major}.{minor})"
    return None


if interpreting() and importlib.util.find_spec("triton") is not None:
    # Triton 3.6's interpreter with NumPy >= 2.4 cannot loop over a loaded scalar.
    from pagedcore_triton._interpreter_compat import patch_scalar_index

    patch_scalar_index()
