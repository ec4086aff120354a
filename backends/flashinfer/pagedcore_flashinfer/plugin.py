"""Entry point of the ``pagedcore.backends`` group: registers `FlashInferBackend`.

Importing this module loads neither torch's CUDA state nor FlashInfer.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedcore import AttentionBackend, hookimpl
from pagedcore_flashinfer.backend import FlashInferBackend
from pagedcore_flashinfer.mla_backend import FlashInferMLABackend

__all__ = ["pagedcore_register_backends"]


@hookimpl
def pagedcore_register_backends() -> Sequence[type[AttentionBackend]]:
    """The flashinfer and flashinfer_mla backends (registered even when FlashInfer is absent:
    the selector then reports why they cannot be used)."""
    return [FlashInferBackend, FlashInferMLABackend]
