"""Plugin discovery (pluggy + entry points) and backend selection.

`registry` loads and validates plugins; `selector` picks a backend for a configuration; both
load on first use so that ``import pagedcore`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pagedcore.plugins.errors import (
    BackendLoadError,
    BackendValidationError,
    DuplicateBackendError,
    PluginError,
    UnknownBackendError,
)
from pagedcore.plugins.hookspecs import ENTRY_POINT_GROUP, hookimpl

if TYPE_CHECKING:
    from pagedcore.plugins.registry import BackendRegistry, get_registry
    from pagedcore.plugins.selector import (
        BackendSelectionError,
        explain_selection,
        select_backend,
    )

_LAZY = {
    "BackendRegistry": "pagedcore.plugins.registry",
    "get_registry": "pagedcore.plugins.registry",
    "BackendSelectionError": "pagedcore.plugins.selector",
    "explain_selection": "pagedcore.plugins.selector",
    "select_backend": "pagedcore.plugins.selector",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedcore.plugins' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "ENTRY_POINT_GROUP",
    "BackendLoadError",
    "BackendRegistry",
    "BackendSelectionError",
    "BackendValidationError",
    "DuplicateBackendError",
    "PluginError",
    "UnknownBackendError",
    "explain_selection",
    "get_registry",
    "hookimpl",
    "select_backend",
]
