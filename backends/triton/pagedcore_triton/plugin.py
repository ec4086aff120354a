"""Entry point module: registers the Triton backend with pagedcore (imports no triton)."""

from __future__ import annotations

from collections.abc import Sequence

import pagedcore
from pagedcore.attention import AttentionBackend
from pagedcore_triton.backend import TritonAttentionBackend


@pagedcore.hookimpl
def pagedcore_register_backends() -> Sequence[type[AttentionBackend]]:
    """The Triton backend."""
    from pagedcore_triton.mla import TritonMLABackend

    return [TritonAttentionBackend, TritonMLABackend]
