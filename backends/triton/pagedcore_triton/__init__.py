"""pagedcore-triton: the Triton paged-attention backend for pagedcore.

Importing this package does not import triton; the kernels load on first use.
"""

from pagedcore_triton.backend import (
    TritonAttentionBackend,
    TritonAttentionMetadata,
    TritonMetadataBuilder,
)
from pagedcore_triton.plan import LaunchPart, SplitRule

__all__ = [
    "LaunchPart",
    "SplitRule",
    "TritonAttentionBackend",
    "TritonAttentionMetadata",
    "TritonMetadataBuilder",
]
