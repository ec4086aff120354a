"""Entry point of the ``pagedcore.backends`` group: registers `FlashAttnBackend`.

Importing this module loads neither torch's CUDA state nor flash-attn.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedcore import AttentionBackend, hookimpl
from pagedcore_flash_attn.backend import FlashAttnBackend

__all__ = ["pagedcore_register_backends"]


@hookimpl
def pagedcore_register_backends() -> Sequence[type[AttentionBackend]]:
    """The flash_attn backend (registered even when flash-attn is absent: the selector then
    reports why it cannot be used)."""
    return [FlashAttnBackend]
