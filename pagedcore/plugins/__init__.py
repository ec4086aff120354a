"""Plugin discovery (pluggy + entry points) and backend selection."""

from pagedcore.plugins.hookspecs import ENTRY_POINT_GROUP, hookimpl

__all__ = ["ENTRY_POINT_GROUP", "hookimpl"]
