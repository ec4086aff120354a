"""Checks a backend class must pass before the registry accepts it.

Every check returns human-readable problems written for the plugin author (what is wrong and
what to do), so a broken plugin fails when it registers, not in the middle of a forward pass.
Each declaration is checked for its type and its value, the way pluggy checks a hook
implementation against its spec: a declaration that is not what `AttentionBackend` documents
(``supported_head_sizes = (128)``, an int; ``supported_dtypes = ("float32")``, a str) or that
raises when read is a problem of that plugin, never a crash of the whole process.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable
from typing import Any, TypeVar

from pagedcore.attention.backend import (
    KV_CACHE_DTYPES,
    AttentionBackend,
    AttentionImpl,
    CudaGraphSupport,
    MetadataBuilder,
    MultipleOf,
)

__all__ = [
    "BACKEND_NAME_PATTERN",
    "PRIORITY_LIMIT",
    "PluginCodeError",
    "backend_problems",
    "call_plugin_code",
    "declaration_problems",
    "describe_error",
    "describe_object",
]

#: Backend names are typed on command lines and in env vars: keep them simple.
BACKEND_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")  # (matched whole)
#: Largest magnitude of a backend's `priority` (built-ins use 2 to 2,000).
PRIORITY_LIMIT = 1_000_000
_DTYPES = ("float16", "bfloat16", "float32")
_DEVICES = ("cpu", "cuda")
_FLAGS = (
    "supports_sliding_window", "supports_mla", "mla_only", "supports_alibi",
    "supports_logits_soft_cap", "supports_sink", "supports_cascade",
    "supports_cascade_cudagraph", "supports_cascade_mixed_cudagraph",
)
T = TypeVar("T")


class PluginCodeError(Exception):
    """Plugin code raised (any `BaseException` but KeyboardInterrupt); ``__cause__`` is it."""

    def __init__(self, what: str, error: BaseException) -> None:
        super().__init__(f"{what} raised {describe_error(error)}")
        self.what = what
        self.error = error


def describe_error(error: BaseException) -> str:
    """``"TypeError: message"`` (``"SystemExit: 3"`` for ``sys.exit(3)``)."""
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def call_plugin_code(what: str, fn: Callable[[], T]) -> T:
    """Run `fn` (plugin code); whatever it raises but a real Ctrl-C becomes `PluginCodeError`.

    `SystemExit` from ``sys.exit()`` in a plugin, or any other `BaseException`, must not end
    the process that merely loaded the plugin.
    """
    try:
        return fn()
    except KeyboardInterrupt:
        raise
    except BaseException as err:  # plugin code is contained, see docstring
        raise PluginCodeError(what, err) from err


def describe_object(obj: Any) -> str:
    """``module.QualName`` of a class or function, else its repr."""
    try:
        qualname = getattr(obj, "__qualname__", None)
        module = getattr(obj, "__module__", None)
        if isinstance(qualname, str) and isinstance(module, str):
            return f"{module}.{qualname}"
        return repr(obj)
    except KeyboardInterrupt:
        raise
    except BaseException:  # a hostile __repr__
        return f"<{type(obj).__name__} object>"


def _abstract_names(cls: type) -> list[str]:
    return sorted(getattr(cls, "__abstractmethods__", ()))


def _kind(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def _sequence_problem(field: str, value: Any, item_type: str, allowed: tuple[Any, ...] | None,
                      check: Callable[[Any], bool], *, none_ok: bool = False) -> str | None:
    """Why `value` is not a non-empty tuple of items passing `check` (None when it is)."""
    expected = f"a non-empty tuple of {item_type}"
    if none_ok:
        expected = f"None (any) or {expected}"
    if allowed is not None:
        expected += f" from {allowed}"
    if value is None and none_ok:
        return None
    if isinstance(value, (str, bytes)) or (not isinstance(value, (tuple, list)) and check(value)):
        # `("float32")` and `(128)` are not tuples: the missing comma.
        return f"`{field}` must be {expected}, got {_kind(value)}: did you mean `({value!r},)`?"
    if not isinstance(value, (tuple, list)):
        return f"`{field}` must be {expected}, got {_kind(value)}"
    if not value:
        return f"`{field}` must be {expected}, got an empty {type(value).__name__}"
    bad = [v for v in value if not check(v)]
    if bad:
        return f"`{field}` must be {expected}; these entries are not: {bad!r}"
    return None


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_dims_pair(value: Any) -> bool:
    return (
        isinstance(value, tuple) and len(value) == 2 and all(_is_positive_int(v) for v in value)
    )


def _checks() -> dict[str, Callable[[Any], str | None]]:
    def names(field: str, allowed: tuple[str, ...]) -> Callable[[Any], str | None]:
        return lambda v: _sequence_problem(
            field, v, "names", allowed, lambda d: isinstance(d, str) and d in allowed
        )

    def priority(v: Any) -> str | None:
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) <= PRIORITY_LIMIT:
            return None
        if isinstance(v, int) and not isinstance(v, bool):
            return (f"`priority` must be an int within +-{PRIORITY_LIMIT:,} (lower wins), "
                    f"got {v}")
        hint = f": did you mean {int(v)}?" if isinstance(v, float) and v.is_integer() else ""
        return f"`priority` must be an int (lower wins), got {_kind(v)}{hint}"

    def cudagraph(v: Any) -> str | None:
        if isinstance(v, CudaGraphSupport):
            return None
        return (
            f"`cudagraph_support` must be a pagedcore.CudaGraphSupport member "
            f"({', '.join(m.name for m in CudaGraphSupport)}), got {_kind(v)}"
        )

    def reason(v: Any) -> str | None:
        if v is None or (isinstance(v, str) and v.strip()):
            return None
        return f"`priority_reason` must be None or a non-empty sentence (str), got {_kind(v)}"

    checks: dict[str, Callable[[Any], str | None]] = {
        "priority": priority,
        "priority_reason": reason,
        "supported_dtypes": names("supported_dtypes", _DTYPES),
        "supported_kv_cache_dtypes": names("supported_kv_cache_dtypes", KV_CACHE_DTYPES),
        "supported_devices": names("supported_devices", _DEVICES),
        "supported_head_sizes": lambda v: _sequence_problem(
            "supported_head_sizes", v, "positive ints", None, _is_positive_int, none_ok=True
        ),
        "supported_block_sizes": lambda v: _sequence_problem(
            "supported_block_sizes", v, "positive ints or MultipleOf(n)", None,
            lambda b: isinstance(b, MultipleOf) or _is_positive_int(b),
        ),
        "supported_mla_dims": lambda v: _sequence_problem(
            "supported_mla_dims", v, "(kv_lora_rank, rope_head_dim) pairs of positive ints",
            None, _is_dims_pair, none_ok=True,
        ),
        "cudagraph_support": cudagraph,
    }
    def flag(field: str) -> Callable[[Any], str | None]:
        def check(v: Any) -> str | None:
            return None if isinstance(v, bool) else (
                f"`{field}` must be True or False, got {_kind(v)}"
            )

        return check

    for name in _FLAGS:
        checks[name] = flag(name)
    return checks


_CHECKS = _checks()


def declaration_problems(cls: type[AttentionBackend]) -> list[str]:
    """Every declaration of `cls` that has the wrong type or value, or raises when read."""
    problems: list[str] = []
    for field, check in _CHECKS.items():
        try:
            value = call_plugin_code(f"reading `{field}`", functools.partial(getattr, cls, field))
        except PluginCodeError as err:
            problems.append(f"{err}; make `{field}` a plain class attribute")
            continue
        try:
            problem = check(value)
        except KeyboardInterrupt:
            raise
        except BaseException as err:  # e.g. a sequence whose __iter__ raises
            problem = f"`{field}` could not be checked: {describe_error(err)}"
        if problem is not None:
            problems.append(problem)
    if not problems and getattr(cls, "supports_cascade_cudagraph", False) and not (
        cls.supports_cascade
        and cls.cudagraph_support >= CudaGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE
    ):
        problems.append(
            "`supports_cascade_cudagraph = True` needs `supports_cascade = True` and "
            "`cudagraph_support >= CudaGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE` (cascade "
            "graphs are decode graphs that cascade); declare both or set it False"
        )
    if not problems and getattr(cls, "supports_cascade_mixed_cudagraph", False) and not (
        cls.supports_cascade_cudagraph and cls.cudagraph_support >= CudaGraphSupport.ALWAYS
    ):
        problems.append(
            "`supports_cascade_mixed_cudagraph = True` needs `supports_cascade_cudagraph = "
            "True` and `cudagraph_support = CudaGraphSupport.ALWAYS` (mixed cascade graphs "
            "are mixed-step graphs that cascade); declare both or set it False"
        )
    return problems


def _role_problems(
    cls: type[AttentionBackend], getter: str, base: type, base_name: str
) -> list[str]:
    try:
        role = call_plugin_code(f"{getter}()", getattr(cls, getter))
    except PluginCodeError as err:  # a plugin's bug, reported to its author
        return [str(err)]
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

    Checks: a subclass of `AttentionBackend`; a valid non-empty ``name``; every declaration of
    the right type and value (see `declaration_problems`); no abstract method left; and, when
    the backend reports itself available, ``get_builder_cls()`` / ``get_impl_cls()`` return
    concrete `MetadataBuilder` / `AttentionImpl` subclasses. (An unavailable backend is not
    asked for its classes: they may import a kernel library that is not installed; it is listed
    as unavailable instead.) Whatever the plugin's code raises (``SystemExit`` included, a real
    Ctrl-C excepted) becomes a problem.
    """
    if not (isinstance(obj, type) and issubclass(obj, AttentionBackend)):
        return [
            f"{describe_object(obj)} is not a subclass of pagedcore.AttentionBackend; "
            "pagedcore_register_backends() must return backend classes (not instances)"
        ]
    problems: list[str] = []
    try:
        name = call_plugin_code("reading `name`", lambda: obj.name)
    except PluginCodeError as err:
        name = None
        problems.append(f"{err}; make `name` a plain class attribute")
    if name is not None and (not isinstance(name, str)
                             or not BACKEND_NAME_PATTERN.fullmatch(name)):
        problems.append(
            f"name must be a non-empty string of letters, digits, '_', '.' or '-', got "
            f"{name!r}; set the class attribute `name`"
        )
    missing = _abstract_names(obj)
    if missing or inspect.isabstract(obj):
        problems.append(
            f"abstract method(s) not implemented: {', '.join(missing)}; implement them as "
            "@classmethod on the backend class"
        )
        return problems + declaration_problems(obj)
    problems += declaration_problems(obj)
    if problems:
        return problems  # is_available() may rely on the declarations
    try:
        why_not = call_plugin_code("is_available()", obj.is_available)
    except PluginCodeError as err:
        return [*problems, str(err)]
    if why_not is not None and (not isinstance(why_not, str) or not why_not.strip()):
        return [*problems, f"is_available() must return None (available) or a non-empty str "
                           f"(why not), got {_kind(why_not)}"]
    if why_not is None:
        problems += _role_problems(obj, "get_builder_cls", MetadataBuilder, "MetadataBuilder")
        problems += _role_problems(obj, "get_impl_cls", AttentionImpl, "AttentionImpl")
    return problems
