"""pagedcore-flex: torch's FlexAttention as a pagedcore backend.

``import pagedcore_flex`` is cheap: ``torch.nn.attention.flex_attention`` is imported when the
builder or impl is first used.
"""

from __future__ import annotations

from pagedcore_flex.backend import FlexBackend

__all__ = ["FlexBackend"]
__version__ = "0.1.0"
