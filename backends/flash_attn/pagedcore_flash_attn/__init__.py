"""pagedcore-flash-attn: the FlashAttention-2 backend for pagedcore.

``import pagedcore_flash_attn`` is cheap: flash-attn is imported on the first forward pass.
"""

from __future__ import annotations

from pagedcore_flash_attn.backend import FlashAttnBackend

__all__ = ["FlashAttnBackend"]
__version__ = "0.1.0"
