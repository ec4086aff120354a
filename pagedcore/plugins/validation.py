"""Checks a backend class must pass before the registry accepts it.

Every check returns human-readable problems written for the plugin author (what is wrong and
what to do), so a broken plugin fails when it registers, not in the middle of a forward pass.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

from pagedcore.attention.backend import (
    KV_CACHE_DTYPES,
    AttentionBackend,
    AttentionImpl,
    MetadataBuilder,
    MultipleOf,
)

__all__ = ["BACKEND_NAME_PATTERN", "backend_problems", "describe_object"]

#: Backend names are typed on command lines and in env vars: keep them simple.
BACKEND_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
_DTYPES = ("float16", "bfloat16", "float32")
_DEVICES = ("cpu", "cuda")


def describe_object(obj: Any) -> str:
    """``module.QualName`` of a class or function, else its repr."""
    qualname = getattr(obj, "__qualname__", None)
    module = getattr(obj, "__module__", None)
    if qualname is not None and module is not None:
        return f"{module}.{qualname}"
    return repr(obj)


def _abstract_names(cls: type) -> list[str]:
    return sorted(getattr(cls, "__abstractmethods__", ()))


def _declaration_problems(cls: type[AttentionBackend]) -> list[str]:
    problems: list[str] = []
    if not isinstance(cls.priority, int) or isinstance(cls.priority, bool):
        problems.append(f"priority must be an int (lower wins), got {cls.priority!r}")
    bad = [d for d in cls.supported_dtypes if d not in _DTYPES]
    if bad:
        problems.append(f"supported_dtypes has unknown names {bad}; use names from {_DTYPES}")
    bad = [d for d in cls.supported_kv_cache_dtypes if d not in KV_CACHE_DTYPES]
    if bad:
        problems.append(
            f"supported_kv_cache_dtypes has unknown names {bad}; use names from {KV_CACHE_DTYPES}"
        )
    bad = [d for d in cls.supported_devices if d not in _DEVICES]
    if bad or not cls.supported_devices:
        problems.append(
            f"supported_devices must be a non-empty tuple drawn from {_DEVICES}, "
            f"got {cls.supported_devices!r}"
        )
    heads = cls.supported_head_sizes
    if heads is not None and (
        not heads or any(not isinstance(h, int) or h <= 0 for h in heads)
    ):
        problems.append(
            f"supported_head_sizes must be None (any) or a non-empty tuple of positive ints, "
            f"got {heads!r}"
        )
    blocks = cls.supported_block_sizes
    if not blocks or any(
        not isinstance(b, MultipleOf) and (not isinstance(b, int) or b <= 0) for b in blocks
    ):
        problems.append(
            "supported_block_sizes must be a non-empty tuple of positive ints or MultipleOf(n), "
            f"got {blocks!r}"
        )
    return problems


def _role_problems(
    cls: type[AttentionBackend], getter: str, base: type, base_name: str
) -> list[str]:
    try:
        role = getattr(cls, getter)()
    except Exception as err:  # a plugin's bug, reported to its author
        return [f"{getter}() raised {type(err).__name__}: {err}"]
    if not (isinstance(role, type) and issubclass(role, base)):
        return [f"{getter}() must return a subclass of {base_name}, got {describe_object(role)}"]
    missing = _abstract_names(role)
    if missing:
        return [
            f"{getter}() returned {describe_object(role)}, which does not implement the "
            f"abstract method(s) {', '.join(missing)}"
        ]
    return []


def backend_problems(obj: Any) -> list[str]:
    """Every reason `obj` is not an acceptable backend class (empty when it is).

    Checks: a subclass of `AttentionBackend`; a valid non-empty ``name``; sane declarations;
    no abstract method left; and, when the backend reports itself available,
    ``get_builder_cls()`` / ``get_impl_cls()`` return concrete `MetadataBuilder` /
    `AttentionImpl` subclasses. (An unavailable backend is not asked for its classes: they may
    import a kernel library that is not installed; it is listed as unavailable instead.)
    """
    if not (isinstance(obj, type) and issubclass(obj, AttentionBackend)):
        return [
            f"{describe_object(obj)} is not a subclass of pagedcore.AttentionBackend; "
            "pagedcore_register_backends() must return backend classes (not instances)"
        ]
    problems: list[str] = []
    name = obj.name
    if not isinstance(name, str) or not BACKEND_NAME_PATTERN.match(name):
        problems.append(
            f"name must be a non-empty string of letters, digits, '_', '.' or '-', got {name!r}; "
            "set the class attribute `name`"
        )
    missing = _abstract_names(obj)
    if missing or inspect.isabstract(obj):
        problems.append(
            f"abstract method(s) not implemented: {', '.join(missing)}; implement them as "
            "@classmethod on the backend class"
        )
        return problems + _declaration_problems(obj)
    problems += _declaration_problems(obj)
    try:
        why_not = obj.is_available()
    except Exception as err:
        return [*problems, f"is_available() raised {type(err).__name__}: {err}"]
    if why_not is None:
        problems += _role_problems(obj, "get_builder_cls", MetadataBuilder, "MetadataBuilder")
        problems += _role_problems(obj, "get_impl_cls", AttentionImpl, "AttentionImpl")
    return problems
