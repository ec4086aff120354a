"""pagedcore's own CUDA paged-attention kernels, registered as the ``cuda_paged`` backend.

Importing this package is cheap: the compiled extension (``pagedcore_cuda_paged._C``) loads
only when a kernel first runs or `CudaPagedBackend.is_available()` is asked.
"""

from __future__ import annotations

from pagedcore_cuda_paged.backend import CudaPagedBackend

__all__ = ["CudaPagedBackend"]
