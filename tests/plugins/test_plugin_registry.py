"""Registry: discovery through (fake) entry points, filtering, failures, validation."""

from __future__ import annotations

import pytest
from plugin_fakes import (
    FakeBackendBase,
    FakeDistribution,
    FakeEntryPoint,
    IncompleteImpl,
    install_entry_points,
    make_backend,
    make_plugin,
)

import pagedcore
from pagedcore.attention import AttentionBackend
from pagedcore.plugins.errors import (
    BackendLoadError,
    BackendValidationError,
    DuplicateBackendError,
    UnknownBackendError,
)
from pagedcore.plugins.registry import (
    BackendRegistry,
    PluginLoadWarning,
    get_registry,
    isolated_registry,
)

ALPHA = make_backend("alpha", priority=10)
BETA = make_backend("beta", priority=20)


def _two_dists(monkeypatch: pytest.MonkeyPatch, broken: BaseException | None = None) -> None:
    eps = [
        FakeEntryPoint("alpha", make_plugin(ALPHA), FakeDistribution("pagedcore-alpha", "1.2")),
        FakeEntryPoint("beta", make_plugin(BETA), FakeDistribution("pagedcore-beta", "0.3")),
    ]
    if broken is not None:
        eps.append(FakeEntryPoint("gamma", broken, FakeDistribution("pagedcore-gamma", "9.9")))
    install_entry_points(monkeypatch, *eps)


def test_discovers_entry_points_with_their_distributions(monkeypatch: pytest.MonkeyPatch) -> None:
    _two_dists(monkeypatch)
    reg = BackendRegistry.from_entry_points()
    assert list(reg.backends) == ["alpha", "beta"]
    entry = reg.backends["beta"]
    assert entry.cls is BETA
    assert (entry.plugin, entry.distribution, entry.version) == ("beta", "pagedcore-beta", "0.3")
    assert entry.source == "pagedcore-beta 0.3"
    assert reg.get("alpha") is ALPHA
    assert reg.failures == ()


def test_plugins_env_restricts_what_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    _two_dists(monkeypatch)
    monkeypatch.setenv("PAGEDCORE_PLUGINS", " beta , ")
    reg = BackendRegistry.from_entry_points()
    assert list(reg.backends) == ["beta"]
    assert reg.excluded == ("alpha",)
    with pytest.raises(UnknownBackendError, match="PAGEDCORE_PLUGINS"):
        reg.get("alpha")


def test_plugins_env_empty_loads_nothing_and_unknown_names_warn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _two_dists(monkeypatch)
    monkeypatch.setenv("PAGEDCORE_PLUGINS", "")
    assert len(BackendRegistry.from_entry_points().backends) == 0
    monkeypatch.setenv("PAGEDCORE_PLUGINS", "alpha,nosuch")
    with pytest.warns(PluginLoadWarning, match="'nosuch'.*installed: alpha, beta"):
        reg = BackendRegistry.from_entry_points()
    assert list(reg.backends) == ["alpha"]


def test_plugin_raising_on_import_is_skipped_then_chained_when_requested(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    original = ImportError("libfancy.so: cannot open shared object file")
    _two_dists(monkeypatch, broken=original)
    with pytest.warns(PluginLoadWarning, match="gamma.*pagedcore-gamma 9.9.*libfancy"):
        reg = BackendRegistry.from_entry_points()
    assert list(reg.backends) == ["alpha", "beta"]  # the others still load
    (failure,) = reg.failures
    assert (failure.plugin, failure.distribution, failure.version) == (
        "gamma", "pagedcore-gamma", "9.9")
    assert failure.error is original and failure.backend is None
    with pytest.raises(BackendLoadError, match=r"'gamma'.*ImportError") as info:
        reg.get("gamma")
    assert info.value.__cause__ is original
    assert isinstance(info.value, ValueError)
    # a backend name nobody registered points at the failed plugin as a suspect
    with pytest.raises(UnknownBackendError, match=r"failed to load.*gamma \(pagedcore-gamma 9.9\)"):
        reg.get("gamma_fast")


def test_hook_raising_is_recorded(registry: BackendRegistry) -> None:
    @pagedcore.hookimpl
    def pagedcore_register_backends() -> list[type[AttentionBackend]]:
        raise RuntimeError("boom in hook")

    plugin = type("P", (), {"pagedcore_register_backends": staticmethod(
        pagedcore_register_backends)})
    with pytest.warns(PluginLoadWarning, match="boom in hook"):
        registry.register_plugin(plugin, name="hooky", distribution="dist-h")
    with pytest.raises(BackendLoadError) as info:
        registry.get("hooky")
    assert isinstance(info.value.__cause__, RuntimeError)


def test_backend_missing_abstract_method_is_rejected(registry: BackendRegistry) -> None:
    class NoImpl(AttentionBackend):  # get_impl_cls and get_kv_cache_shape missing
        name = "noimpl"

        @classmethod
        def get_builder_cls(cls) -> type:  # type: ignore[override]
            return object

    with pytest.warns(PluginLoadWarning, match="noimpl"):
        registry.register_plugin(make_plugin(NoImpl, ALPHA), name="p1", distribution="d1")
    assert list(registry.backends) == ["alpha"]  # the valid sibling is kept
    (failure,) = registry.failures
    assert failure.backend == "noimpl"
    assert "get_impl_cls" in failure.message and "get_kv_cache_shape" in failure.message
    with pytest.raises(BackendLoadError, match="abstract method") as info:
        registry.get("noimpl")
    assert isinstance(info.value.__cause__, BackendValidationError)


def test_impl_class_with_abstract_forward_is_rejected(registry: BackendRegistry) -> None:
    half = make_backend("half", get_impl_cls=classmethod(lambda cls: IncompleteImpl))
    with pytest.warns(PluginLoadWarning):
        registry.register_plugin(make_plugin(half), name="p2")
    assert "half" not in registry
    assert "IncompleteImpl" in registry.failures[0].message
    assert "forward" in registry.failures[0].message


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        (object, "not a subclass of pagedcore.AttentionBackend"),
        (make_backend(""), "name must be a non-empty string"),
        (make_backend("has space"), "name must be"),
        (make_backend("devs", devices=("tpu",)), "supported_devices"),
        (make_backend("heads", head_sizes=(0,)), "supported_head_sizes"),
        (make_backend("dtypes", supported_dtypes=("float64",)), "supported_dtypes"),
    ],
)
def test_invalid_backend_declarations_are_rejected(
    registry: BackendRegistry, bad: object, needle: str
) -> None:
    with pytest.warns(PluginLoadWarning):
        registry.register_plugin(make_plugin(bad), name="bad")
    assert len(registry.backends) == 0
    assert needle in registry.failures[0].message


def test_hook_returning_non_sequence_and_undecorated_hook(registry: BackendRegistry) -> None:
    @pagedcore.hookimpl
    def pagedcore_register_backends() -> object:
        return ALPHA  # a class, not a list of classes

    ns = type("NS", (), {"pagedcore_register_backends": staticmethod(
        pagedcore_register_backends)})
    with pytest.warns(PluginLoadWarning, match="sequence of backend classes"):
        registry.register_plugin(ns, name="nonseq")

    def undecorated() -> list[type[AttentionBackend]]:
        return [ALPHA]

    plain = type("Plain", (), {"pagedcore_register_backends": staticmethod(undecorated)})
    with pytest.warns(PluginLoadWarning, match="decorate it with @pagedcore.hookimpl"):
        registry.register_plugin(plain, name="plain")
    assert len(registry.backends) == 0


def test_duplicate_names_name_both_distributions(monkeypatch: pytest.MonkeyPatch) -> None:
    other_alpha = make_backend("alpha", priority=1)
    install_entry_points(
        monkeypatch,
        FakeEntryPoint("second", make_plugin(other_alpha), FakeDistribution("zeta-dist", "2")),
        FakeEntryPoint("first", make_plugin(ALPHA), FakeDistribution("alpha-dist", "1")),
    )
    with pytest.warns(PluginLoadWarning, match="registered twice"):
        reg = BackendRegistry.from_entry_points()
    assert reg.get("alpha") is ALPHA  # deterministic: distributions load in name order
    (failure,) = reg.failures
    assert isinstance(failure.error, DuplicateBackendError)
    assert "alpha-dist 1" in failure.message and "zeta-dist 2" in failure.message
    assert failure.backend == "alpha"


def test_core_distribution_loads_first(monkeypatch: pytest.MonkeyPatch) -> None:
    impostor = make_backend("alpha", priority=1)
    install_entry_points(
        monkeypatch,
        FakeEntryPoint("aaa", make_plugin(impostor), FakeDistribution("aaa-dist")),
        FakeEntryPoint("core", make_plugin(ALPHA), FakeDistribution("pagedcore", "0.1.0")),
    )
    with pytest.warns(PluginLoadWarning):
        reg = BackendRegistry.from_entry_points()
    assert reg.get("alpha") is ALPHA


def test_unknown_name_lists_valid_names_and_close_matches(registry: BackendRegistry) -> None:
    registry.register_plugin(make_plugin(ALPHA, BETA), name="ab")
    with pytest.raises(UnknownBackendError) as info:
        registry.get("alpah")
    message = str(info.value)
    assert "'alpah'" in message and "alpha, beta" in message and "Did you mean 'alpha'" in message


def test_register_unregister_bump_generation(registry: BackendRegistry) -> None:
    g0 = registry.generation
    registry.register_plugin(make_plugin(ALPHA), name="a")
    g1 = registry.generation
    assert g1 > g0
    with pytest.raises(ValueError, match="already registered"):
        registry.register_plugin(make_plugin(BETA), name="a")
    with registry.temporary_plugin(make_plugin(BETA), name="b"):
        assert set(registry.backends) == {"alpha", "beta"}
        assert registry.generation > g1
    assert set(registry.backends) == {"alpha"}
    registry.unregister_plugin("a")
    assert len(registry.backends) == 0 and registry.plugin_names == ()
    with pytest.raises(ValueError, match="no plugin named 'a'"):
        registry.unregister_plugin("a")


def test_unregister_forgets_failures(registry: BackendRegistry) -> None:
    with pytest.warns(PluginLoadWarning):
        registry.register_plugin(make_plugin(make_backend("")), name="bad")
    registry.unregister_plugin("bad")
    assert registry.failures == ()


def test_failure_warned_once(registry: BackendRegistry, recwarn: pytest.WarningsRecorder) -> None:
    for name in ("w1", "w2"):
        with isolated_registry() as reg:
            reg.register_plugin(make_plugin(object), name="same", distribution="d")
        del name
    assert len([w for w in recwarn if issubclass(w.category, PluginLoadWarning)]) == 1


def test_get_registry_is_shared_and_reloads_when_env_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _two_dists(monkeypatch)
    with isolated_registry(BackendRegistry.from_entry_points()):
        first = get_registry()
        assert get_registry() is first and set(first.backends) == {"alpha", "beta"}
        monkeypatch.setenv("PAGEDCORE_PLUGINS", "alpha")
        second = get_registry()
        assert second is not first and set(second.backends) == {"alpha"}
        assert get_registry(reload=True) is not second


def test_unavailable_backend_is_not_asked_for_its_classes(registry: BackendRegistry) -> None:
    def explode(cls: type) -> type:
        raise ImportError("kernel library missing")

    class Unavailable(FakeBackendBase):
        name = "unavail"

        @classmethod
        def is_available(cls) -> str | None:
            return "no GPU here"

        get_impl_cls = classmethod(explode)  # type: ignore[assignment]

    registry.register_plugin(make_plugin(Unavailable), name="u")
    assert "unavail" in registry  # listed (as unavailable), not failed


def test_misspelled_hook_is_rejected_by_pluggy(registry: BackendRegistry) -> None:
    @pagedcore.hookimpl
    def pagedcore_register_backend() -> list[type[AttentionBackend]]:  # missing "s"
        return [ALPHA]

    typo = type("Typo", (), {"pagedcore_register_backend": staticmethod(
        pagedcore_register_backend)})
    with pytest.warns(PluginLoadWarning, match="pluggy rejected it.*unknown hook"):
        registry.register_plugin(typo, name="typo", distribution="typo-dist")
    assert len(registry.backends) == 0 and registry.plugin_names == ("typo",)
    with pytest.raises(BackendLoadError, match="pagedcore_register_backend"):
        registry.get("typo")
