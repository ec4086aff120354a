"""pagedcore-flashinfer: the FlashInfer backend for pagedcore.

``import pagedcore_flashinfer`` is cheap: FlashInfer is imported on the first plan.
"""

from __future__ import annotations

from pagedcore_flashinfer.backend import FlashInferBackend
from pagedcore_flashinfer.mla_backend import FlashInferMLABackend

__all__ = ["FlashInferBackend", "FlashInferMLABackend"]
__version__ = "0.1.0"
