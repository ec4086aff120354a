"""Errors raised by the plugin registry and the backend selector (all are ValueErrors)."""

from __future__ import annotations

__all__ = [
    "BackendLoadError",
    "BackendSetupError",
    "BackendValidationError",
    "DuplicateBackendError",
    "PluginError",
    "UnknownBackendError",
]


class PluginError(ValueError):
    """Base class of every plugin/backend lookup error."""


class BackendValidationError(PluginError):
    """A backend class a plugin returned does not satisfy the `AttentionBackend` contract."""


class DuplicateBackendError(PluginError):
    """Two plugins registered backends with the same name."""


class BackendLoadError(PluginError):
    """A backend was asked for by name, but its plugin failed to load or validate.

    Always raised ``from`` the original error, so the traceback shows what went wrong.
    """


class UnknownBackendError(PluginError):
    """No backend of that name is registered, and no failed plugin claims it."""


class BackendSetupError(PluginError):
    """A registered backend's code failed, or broke the contract, while an engine set it up
    (its builder, its impls, its KV-cache shape): the message names the backend and the
    distribution it came from. Raised ``from`` the original error."""
