"""What the registry records: accepted backends and skipped plugins."""

from __future__ import annotations

import attrs

from pagedcore.attention.backend import AttentionBackend

__all__ = ["PluginFailure", "PluginLoadWarning", "RegisteredBackend", "dist_label"]


class PluginLoadWarning(UserWarning):
    """A plugin failed to load or one of its backends was rejected (it is skipped)."""


def dist_label(distribution: str | None, version: str | None) -> str:
    """``"name version"`` of a distribution, or a placeholder when there is none."""
    if distribution is None:
        return "<no distribution>"
    return distribution if version is None else f"{distribution} {version}"


@attrs.frozen
class RegisteredBackend:
    """A backend class the registry accepted, and where it came from."""

    cls: type[AttentionBackend]
    plugin: str
    distribution: str | None = None
    version: str | None = None

    @property
    def name(self) -> str:
        return self.cls.name

    @property
    def source(self) -> str:
        """``"distribution version"`` (or a placeholder for programmatic registrations)."""
        return dist_label(self.distribution, self.version)


@attrs.frozen
class PluginFailure:
    """A plugin (or one backend of it) that was skipped, with the original error.

    Attributes
    ----------
    plugin:
        Entry-point (or programmatic registration) name.
    distribution, version:
        The installed distribution that provides it, when known.
    error:
        The original exception; `BackendRegistry.get` chains to it.
    message:
        One line for humans: what went wrong and what to do.
    backend:
        Name of the rejected backend when known; None when the whole plugin failed.
    """

    plugin: str
    distribution: str | None
    version: str | None
    error: BaseException
    message: str
    backend: str | None = None

    @property
    def source(self) -> str:
        return dist_label(self.distribution, self.version)

    def describe(self) -> str:
        what = f"plugin {self.plugin!r} ({self.source})"
        if self.backend is not None:
            what = f"backend {self.backend!r} of {what}"
        return f"{what}: {self.message}"
