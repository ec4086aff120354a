"""Calls into a selected backend's code while the engine sets it up, contained and named.

A backend passed registration (its declarations are checked then), but its builder, its
impls and its KV-cache shape run only when an engine builds them. A failure there is the
backend's, not the user's: `backend_call` turns it into a `BackendSetupError` naming the
backend and the distribution it came from (not a bare ``TypeError`` from deep inside the
runner), and `checked_kv_cache_shape` refuses a shape that is no shape or too small for the
blocks, before it could fail mid-forward.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

from pagedcore.plugins.errors import BackendSetupError

__all__ = ["backend_call", "backend_label", "checked_kv_cache_shape"]

T = TypeVar("T")


def backend_label(backend: type[Any]) -> str:
    """``backend 'name' (distribution version)``, or ``(registered in code)``."""
    from pagedcore.plugins.registry import get_registry

    name = getattr(backend, "name", backend.__name__)
    entry = get_registry().backends.get(name)
    source = entry.source if entry is not None and entry.cls is backend else "registered in code"
    return f"backend {name!r} ({source})"


def backend_call(backend: type[Any], what: str, fn: Callable[..., T], /, *args: Any,
                 **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``, the backend's code doing `what`; any exception but a Ctrl-C
    (or an error that already names it) becomes a `BackendSetupError` naming the backend."""
    try:
        return fn(*args, **kwargs)
    except (KeyboardInterrupt, BackendSetupError):
        raise
    except Exception as err:
        raise BackendSetupError(
            f"{backend_label(backend)} failed while the engine set it up: {what} raised "
            f"{type(err).__name__}: {err}; that is a bug of the backend (report it to its "
            "authors), or choose another backend"
        ) from err


def checked_kv_cache_shape(backend: type[Any], shape: Any, *, min_elements: int,
                           what: str) -> tuple[int, ...]:
    """`shape` (from `backend`'s ``get_kv_cache_shape``) as a tuple of positive ints holding
    at least `min_elements` elements (the blocks' K and V); else a `BackendSetupError`."""
    dims: tuple[Any, ...] | None = None
    if isinstance(shape, (tuple, list)):  # (a torch.Size is a tuple)
        dims = tuple(shape)
    if dims is None or not dims or not all(
            isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims):
        raise BackendSetupError(
            f"{backend_label(backend)}: {what} returned {shape!r:.80}, not a tuple of positive "
            "ints; that is a bug of the backend (report it to its authors)")
    if math.prod(dims) < min_elements:
        raise BackendSetupError(
            f"{backend_label(backend)}: {what} returned {dims}, {math.prod(dims):,} elements, "
            f"fewer than the {min_elements:,} its blocks hold; that is a bug of the backend "
            "(report it to its authors)")
    return dims

