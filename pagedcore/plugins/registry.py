"""The backend registry: entry-point discovery, pluggy registration and validation.

Discovery iterates ``importlib.metadata.entry_points(group="pagedcore.backends")``, restricted
by the ``PAGEDCORE_PLUGINS`` environment variable (a comma list of entry-point names; unset
loads every plugin, an empty value loads none). Each entry point names a module or object that
holds a ``@pagedcore.hookimpl def pagedcore_register_backends()``; it is registered with a
pluggy ``PluginManager`` and each backend class it returns is validated (see
`pagedcore.plugins.validation`).

A plugin that fails to import, register or validate never breaks loading: it is recorded as a
`PluginFailure` and warned about once. It becomes a hard error, chained to the original
exception, only when its backend is asked for by name (`BackendRegistry.get`).

Examples
--------
>>> from pagedcore.plugins.registry import get_registry
>>> registry = get_registry()
>>> sorted(registry.backends)  # doctest: +SKIP
['reference', 'triton']
>>> registry.get("reference")  # doctest: +SKIP
<class 'pagedcore.reference.backend.ReferenceBackend'>
"""

from __future__ import annotations

import difflib
import itertools
import logging
import os
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any, final

import pluggy

from pagedcore.attention.backend import AttentionBackend
from pagedcore.plugins import hookspecs
from pagedcore.plugins.discovery import discover, parse_allowlist
from pagedcore.plugins.errors import (
    BackendLoadError,
    BackendValidationError,
    DuplicateBackendError,
    PluginError,
    UnknownBackendError,
)
from pagedcore.plugins.records import (
    PluginFailure,
    PluginLoadWarning,
    RegisteredBackend,
    dist_label,
)
from pagedcore.plugins.validation import (
    PluginCodeError,
    backend_problems,
    call_plugin_code,
    describe_error,
    describe_object,
)

__all__ = [
    "PLUGINS_ENV",
    "BackendRegistry",
    "PluginFailure",
    "PluginLoadWarning",
    "RegisteredBackend",
    "get_registry",
    "isolated_registry",
]

#: Comma list of entry-point names to load; unset = all, empty = none.
PLUGINS_ENV = "PAGEDCORE_PLUGINS"

# One counter for every registry, so a fresh registry never reuses a cached generation.
_GENERATIONS = itertools.count(1)
_WARNED: set[str] = set()
#: Plugin failures are logged here (once each); `pagedcore backends` shows them all.
logger = logging.getLogger("pagedcore.plugins")


@final
class BackendRegistry:
    """Registered backends, failed plugins, and a `generation` bumped on every change.

    Create one with `BackendRegistry.from_entry_points()` (what `get_registry` does) or empty,
    then add plugins programmatically with `register_plugin` (tests, tools).
    """

    def __init__(self) -> None:
        self._pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)
        self._backends: dict[str, RegisteredBackend] = {}
        self._failures: list[PluginFailure] = []
        self._plugins: dict[str, tuple[str | None, str | None]] = {}
        #: Value of PAGEDCORE_PLUGINS this registry was loaded with (None: unset or not loaded).
        self.plugins_env: str | None = None
        #: True when loaded from entry points (then `get_registry` reloads it if the env changes).
        self.from_environment = False
        #: Installed entry-point names that PAGEDCORE_PLUGINS excluded.
        self.excluded: tuple[str, ...] = ()
        self.generation = next(_GENERATIONS)

    # -- loading -----------------------------------------------------------------------------

    @classmethod
    def from_entry_points(cls, *, allowlist: Sequence[str] | str | None = "env") -> BackendRegistry:
        """A registry loaded from the ``pagedcore.backends`` entry points.

        Parameters
        ----------
        allowlist:
            Entry-point names to load; None loads all; the default ``"env"`` reads
            ``PAGEDCORE_PLUGINS``.
        """
        registry = cls()
        if isinstance(allowlist, str):
            registry.plugins_env = os.environ.get(PLUGINS_ENV)
            registry.from_environment = True
            names = parse_allowlist(registry.plugins_env)
        else:
            names = None if allowlist is None else tuple(allowlist)
        registry.load_entry_points(allowlist=names)
        return registry

    def load_entry_points(self, *, allowlist: Sequence[str] | None = None) -> None:
        """Load every entry point of the group (only those in `allowlist`, when given)."""
        found = discover(allowlist)
        for ep, distribution, version in found.selected:
            try:
                obj = call_plugin_code(f"importing {ep.value!r}", ep.load)
            except PluginCodeError as err:
                self._fail(
                    ep.name, distribution, version, err.error,
                    f"importing {ep.value!r} failed with {describe_error(err.error)}; "
                    f"fix or reinstall the package, or leave it out with {PLUGINS_ENV}",
                )
                continue
            self._add_plugin(obj, ep.name, distribution, version)
        self.excluded = found.excluded
        for name in found.unmatched:
            self._warn(
                f"{PLUGINS_ENV} lists {name!r}, but no installed plugin has that entry-point "
                f"name (installed: {', '.join(found.installed) or 'none'})"
            )
        self._bump()

    # -- programmatic registration -------------------------------------------------------------

    def register_plugin(
        self,
        obj: object,
        *,
        name: str,
        distribution: str | None = None,
        version: str | None = None,
    ) -> None:
        """Register `obj` (a module or object with hook implementations) as plugin `name`.

        Failures are recorded and warned about, exactly as for an entry point. A plugin name
        that is already registered is a programming error and raises ValueError.
        """
        if name in self._plugins:
            raise ValueError(
                f"a plugin named {name!r} is already registered; unregister_plugin({name!r}) "
                "first or pick another name"
            )
        self._add_plugin(obj, name, distribution, version)
        self._bump()

    def unregister_plugin(self, name: str) -> None:
        """Remove plugin `name`, its backends and its recorded failures."""
        if name not in self._plugins:
            raise ValueError(
                f"no plugin named {name!r} is registered (registered: "
                f"{', '.join(sorted(self._plugins)) or 'none'})"
            )
        del self._plugins[name]
        if self._pm.has_plugin(name):
            self._pm.unregister(name=name)
        self._backends = {k: v for k, v in self._backends.items() if v.plugin != name}
        self._failures = [f for f in self._failures if f.plugin != name]
        self._bump()

    @contextmanager
    def temporary_plugin(
        self, obj: object, *, name: str, distribution: str | None = None
    ) -> Iterator[BackendRegistry]:
        """Register `obj` for the duration of a ``with`` block (handy in tests)."""
        self.register_plugin(obj, name=name, distribution=distribution)
        try:
            yield self
        finally:
            self.unregister_plugin(name)

    # -- queries -------------------------------------------------------------------------------

    @property
    def backends(self) -> Mapping[str, RegisteredBackend]:
        """Backend name -> `RegisteredBackend`, in registration order (read-only view)."""
        return MappingProxyType(self._backends)

    @property
    def failures(self) -> tuple[PluginFailure, ...]:
        """Plugins and backends that were skipped, in the order they failed."""
        return tuple(self._failures)

    @property
    def plugin_names(self) -> tuple[str, ...]:
        return tuple(self._plugins)

    def __contains__(self, name: object) -> bool:
        return name in self._backends

    def get(self, name: str) -> type[AttentionBackend]:
        """The backend class registered as `name`.

        Raises
        ------
        BackendLoadError
            `name` belongs to a plugin that failed (chained to the original error).
        UnknownBackendError
            Nothing is known by that name; the message lists the valid names.
        """
        found = self._backends.get(name)
        if found is not None:
            return found.cls
        failure = self._failure_for(name)
        if failure is not None:
            raise BackendLoadError(
                f"backend {name!r} was requested, but {failure.describe()}"
            ) from failure.error
        raise UnknownBackendError(self.unknown_name_message(name))

    def unknown_name_message(self, name: str) -> str:
        """Why `name` is unknown: valid names, close matches, plugins left out by the env."""
        valid = sorted(self._backends)
        message = f"unknown attention backend {name!r}; registered backends: "
        message += ", ".join(valid) if valid else "none"
        close = difflib.get_close_matches(name, valid, n=3)
        if close:
            message += f". Did you mean {' or '.join(map(repr, close))}?"
        if name in self.excluded:
            message += (
                f". A plugin named {name!r} is installed but {PLUGINS_ENV}="
                f"{self.plugins_env!r} leaves it out; add it there or unset {PLUGINS_ENV}"
            )
        elif not close:
            message += (
                ". Install the package that provides it, or run `pagedcore backends` "
                "to see what is installed"
            )
        failed = sorted({f"{f.plugin} ({f.source})" for f in self._failures if f.backend is None})
        if failed:
            message += f". Plugins that failed to load (one may provide it): {', '.join(failed)}"
        return message

    # -- internals -----------------------------------------------------------------------------

    def _failure_for(self, name: str) -> PluginFailure | None:
        for failure in self._failures:
            if failure.backend == name:
                return failure
        for failure in self._failures:
            if failure.backend is None and failure.plugin == name:
                return failure
        return None

    def _bump(self) -> None:
        self.generation = next(_GENERATIONS)

    def _warn(self, message: str) -> None:
        """Report `message` once per process: a log record, and a `PluginLoadWarning` for
        library users (the `pagedcore` command silences the warning; `pagedcore backends`
        lists every failure instead)."""
        if message not in _WARNED:
            _WARNED.add(message)
            logger.warning("%s", message)
            warnings.warn(f"pagedcore: {message}", PluginLoadWarning, stacklevel=4)

    def _fail(
        self,
        plugin: str,
        distribution: str | None,
        version: str | None,
        error: BaseException,
        message: str,
        backend: str | None = None,
    ) -> None:
        failure = PluginFailure(plugin, distribution, version, error, message, backend)
        self._failures.append(failure)
        self._warn(f"skipped {failure.describe()}")

    def _call_hook(
        self, obj: object, name: str, distribution: str | None, version: str | None
    ) -> list[Any] | None:
        """Register `obj` with pluggy and call its hook; None (recorded) when that fails."""
        try:
            self._pm.register(obj, name=name)
            self._pm.check_pending()
        except KeyboardInterrupt:
            raise
        except BaseException as err:  # a hostile plugin object
            if self._pm.has_plugin(name):
                self._pm.unregister(name=name)
            self._fail(name, distribution, version, err,
                       f"pluggy rejected it: {describe_error(err)}")
            return None
        hook = self._pm.hook.pagedcore_register_backends
        impls = [impl for impl in hook.get_hookimpls() if impl.plugin_name == name]
        if not impls:
            try:
                has_function = hasattr(obj, "pagedcore_register_backends")
            except KeyboardInterrupt:
                raise
            except BaseException:  # a hostile __getattr__
                has_function = False
            hint = (
                "it has a function of that name: decorate it with @pagedcore.hookimpl"
                if has_function
                else "add `@pagedcore.hookimpl def pagedcore_register_backends(): ...`"
            )
            missing = BackendValidationError(
                f"{describe_object(obj)} has no pagedcore_register_backends hook implementation"
            )
            self._fail(name, distribution, version, missing, f"{missing}; {hint}")
            return None
        try:
            result = call_plugin_code("pagedcore_register_backends()", impls[0].function)
        except PluginCodeError as err:
            self._fail(name, distribution, version, err.error, str(err))
            return None
        if isinstance(result, (str, bytes)) or not isinstance(result, Sequence):
            bad = BackendValidationError(
                f"pagedcore_register_backends() must return a sequence of backend classes, "
                f"got {type(result).__name__}"
            )
            self._fail(name, distribution, version, bad, str(bad))
            return None
        try:
            return call_plugin_code("iterating the hook's result", lambda: list(result))
        except PluginCodeError as err:
            self._fail(name, distribution, version, err.error, str(err))
            return None

    def _add_plugin(
        self, obj: object, name: str, distribution: str | None, version: str | None
    ) -> None:
        if name in self._plugins:
            taken = PluginError(
                f"plugin name {name!r} is already taken by "
                f"{dist_label(*self._plugins[name])}"
            )
            self._fail(name, distribution, version, taken,
                       f"{taken}; uninstall one of the two distributions")
            return
        self._plugins[name] = (distribution, version)
        result = self._call_hook(obj, name, distribution, version)
        for item in result or ():
            self._add_backend(item, name, distribution, version)

    def _add_backend(
        self, item: Any, plugin: str, distribution: str | None, version: str | None
    ) -> None:
        try:
            backend_name = call_plugin_code("name", lambda: getattr(item, "name", None))
        except PluginCodeError:
            backend_name = None
        label = backend_name if isinstance(backend_name, str) and backend_name else None
        problems = backend_problems(item)
        if problems:
            invalid = BackendValidationError(
                f"{describe_object(item)} is not a valid backend: " + "; ".join(problems)
            )
            self._fail(plugin, distribution, version, invalid, str(invalid), label)
            return
        assert isinstance(item, type) and issubclass(item, AttentionBackend)
        existing = self._backends.get(item.name)
        if existing is not None:
            if existing.cls is item:
                return
            dup = DuplicateBackendError(
                f"backend name {item.name!r} is registered twice: by plugin "
                f"{existing.plugin!r} of {existing.source} ({describe_object(existing.cls)}) and "
                f"by plugin {plugin!r} of {dist_label(distribution, version)} "
                f"({describe_object(item)}); the second was rejected. Uninstall one of the two "
                f"distributions, rename one backend, or choose with {PLUGINS_ENV}"
            )
            self._fail(plugin, distribution, version, dup, str(dup), item.name)
            return
        self._backends[item.name] = RegisteredBackend(item, plugin, distribution, version)


_REGISTRY: BackendRegistry | None = None
# Re-entrant: plugin code running while the registry loads (its import, its hook) may call
# back into pagedcore on this thread; `_LOADING` turns that into the plugin's own failure
# instead of a deadlock (another thread just waits for the load).
_LOCK = threading.RLock()
_LOADING = False


def get_registry(*, reload: bool = False) -> BackendRegistry:
    """The process-wide registry, loaded from entry points on first use.

    It is reloaded when `reload` is true or when ``PAGEDCORE_PLUGINS`` changed since it was
    loaded (so a changed plugin set is always noticed).
    """
    global _REGISTRY, _LOADING
    with _LOCK:
        if _LOADING:
            raise RuntimeError(
                "a plugin called into pagedcore's backend registry (select_backend, "
                "get_registry, ...) while the registry was loading the plugins; a plugin's "
                "import and its pagedcore_register_backends hook must only return backend "
                "classes: select backends later, at run time")
        current = _REGISTRY
        stale = (
            current is not None
            and current.from_environment
            and current.plugins_env != os.environ.get(PLUGINS_ENV)
        )
        if reload or current is None or stale:
            _LOADING = True
            try:
                current = BackendRegistry.from_entry_points()
            finally:
                _LOADING = False
            _REGISTRY = current
        return current


@contextmanager
def isolated_registry(registry: BackendRegistry | None = None) -> Iterator[BackendRegistry]:
    """Make `registry` (default: a new empty one) the process-wide registry inside a block.

    For tests and tools that want exactly the plugins they register, nothing installed.
    """
    global _REGISTRY
    with _LOCK:
        previous = _REGISTRY
        _REGISTRY = BackendRegistry() if registry is None else registry
        installed = _REGISTRY
    try:
        yield installed
    finally:
        with _LOCK:
            _REGISTRY = previous
