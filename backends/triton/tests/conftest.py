"""Run the kernels in Triton's interpreter on CPU tensors when no CUDA GPU is present.

TRITON_INTERPRET must be set before triton (or pagedcore_triton) is first imported.
"""

from __future__ import annotations

import os


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
