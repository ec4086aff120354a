"""Run Triton kernels in the interpreter on CPU tensors when no CUDA GPU is present.

TRITON_INTERPRET must be set before pagedcore_triton's kernels are first imported.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
