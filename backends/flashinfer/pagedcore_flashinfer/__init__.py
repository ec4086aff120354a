"""pagedcore-flashinfer: the FlashInfer backend for pagedcore.

``import pagedcore_flashinfer`` is cheap: FlashInfer is imported on the first plan.
"""

from __future__ import annotations

from pagedcore_flashinfer.backend import FlashInferBackend

__all__ = ["FlashInferBackend"]
__version__ = "0.1.0"
