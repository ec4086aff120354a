"""Registers the reference backends through the same hook a third-party plugin uses."""

from __future__ import annotations

from collections.abc import Sequence

import pagedcore
from pagedcore.attention.backend import AttentionBackend


@pagedcore.hookimpl
def pagedcore_register_backends() -> Sequence[type[AttentionBackend]]:
    """The reference backend and the reference MLA backend."""
    from pagedcore.reference.backend import ReferenceBackend
    from pagedcore.reference.mla import ReferenceMLABackend

    return [ReferenceBackend, ReferenceMLABackend]
