"""Finding plugins: the ``pagedcore.backends`` entry points, in load order, allow-list applied."""

from __future__ import annotations

from collections.abc import Sequence
from importlib import metadata
from typing import Any

import attrs

from pagedcore.plugins.hookspecs import ENTRY_POINT_GROUP

__all__ = ["CORE_DISTRIBUTION", "Discovery", "discover", "parse_allowlist"]

#: Distribution of the core package: its plugins load first, so they win a name clash.
CORE_DISTRIBUTION = "pagedcore"


@attrs.frozen
class Discovery:
    """Entry points to load (in order, with their distribution) and what the allow-list left out.

    Attributes
    ----------
    selected:
        ``(entry point, distribution name or None, version or None)`` in load order: the core
        distribution first, then by distribution name, then by entry-point name.
    excluded:
        Installed entry-point names the allow-list left out.
    unmatched:
        Allow-list names no installed entry point has.
    installed:
        Every installed entry-point name of the group.
    """

    selected: tuple[tuple[Any, str | None, str | None], ...]
    excluded: tuple[str, ...]
    unmatched: tuple[str, ...]
    installed: tuple[str, ...]


def parse_allowlist(value: str | None) -> tuple[str, ...] | None:
    """``"a, b,"`` -> ``("a", "b")``; None (unset) -> None, meaning "all"."""
    if value is None:
        return None
    return tuple(part.strip() for part in value.split(",") if part.strip())


def _source(ep: Any) -> tuple[str | None, str | None]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None, None
    name = getattr(dist, "name", None)
    if name is None:
        name = dist.metadata["Name"]
    return str(name), getattr(dist, "version", None)


def discover(allowlist: Sequence[str] | None) -> Discovery:
    """The group's entry points, via ``importlib.metadata.entry_points`` (looked up at call
    time, so tests can monkeypatch it), filtered by `allowlist` (None: all)."""
    eps = list(metadata.entry_points(group=ENTRY_POINT_GROUP))
    found = [(ep, *_source(ep)) for ep in eps]
    found.sort(key=lambda f: (f[1] != CORE_DISTRIBUTION, f[1] or "", f[0].name))
    keep = [allowlist is None or f[0].name in allowlist for f in found]
    selected = tuple(f for f, k in zip(found, keep, strict=True) if k)
    excluded = tuple(f[0].name for f, k in zip(found, keep, strict=True) if not k)
    installed = tuple(sorted({ep.name for ep in eps}))
    unmatched = tuple(n for n in (allowlist or ()) if n not in installed)
    return Discovery(selected, excluded, unmatched, installed)
