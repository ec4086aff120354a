"""The module the ``pagedcore.backends`` entry point names: it holds the hook implementation."""

from __future__ import annotations

from collections.abc import Sequence

import pagedcore
from pagedcore_toy_sdpa.backend import ToySdpaBackend


@pagedcore.hookimpl
def pagedcore_register_backends() -> Sequence[type[pagedcore.AttentionBackend]]:
    """The backends this distribution provides."""
    return [ToySdpaBackend]
