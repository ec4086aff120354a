"""Entry point of the ``pagedcore.backends`` group: registers `FlexBackend`.

Importing this module imports neither FlexAttention nor CUDA state.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedcore import AttentionBackend, hookimpl
from pagedcore_flex.backend import FlexBackend

__all__ = ["pagedcore_register_backends"]


@hookimpl
def pagedcore_register_backends() -> Sequence[type[AttentionBackend]]:
    """The flex backend (registered even when torch lacks FlexAttention: the selector then
    reports why it cannot be used)."""
    return [FlexBackend]
