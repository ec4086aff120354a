"""Issue #27: no plugin can take pagedcore down (bad declarations, BaseExceptions, noise)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from importlib import metadata
from typing import Any

import pytest
from click.testing import CliRunner
from plugin_fakes import (
    FakeDistribution,
    FakeEntryPoint,
    make_backend,
    make_plugin,
)

import pagedcore
from pagedcore.attention import MetadataBuilder
from pagedcore.cli import main
from pagedcore.plugins.hookspecs import ENTRY_POINT_GROUP
from pagedcore.plugins.registry import BackendRegistry, PluginLoadWarning, get_registry


class Raising:
    """A declaration descriptor that raises `error` when read from the class."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __get__(self, obj: Any, owner: Any) -> Any:
        raise self.error


def _exiting_classmethod(name: str) -> Any:
    def method(cls: Any, *args: Any) -> Any:
        sys.exit(f"{name} says bye")

    return classmethod(method)


#: declaration -> (value, text the failure message must contain)
BAD_DECLARATIONS: dict[str, tuple[str, Any, str]] = {
    "head_int": ("supported_head_sizes", 128,
                 "`supported_head_sizes` must be None (any) or a non-empty tuple of positive "
                 "ints, got int 128: did you mean `(128,)`?"),
    "dtypes_none": ("supported_dtypes", None, "`supported_dtypes` must be a non-empty tuple"),
    "dtypes_str": ("supported_dtypes", "float32", "did you mean `('float32',)`?"),
    "kv_str": ("supported_kv_cache_dtypes", "auto", "did you mean `('auto',)`?"),
    "devices_str": ("supported_devices", "cpu", "did you mean `('cpu',)`?"),
    "blocks_int": ("supported_block_sizes", 16, "did you mean `(16,)`?"),
    "blocks_bool": ("supported_block_sizes", (True,), "these entries are not: [True]"),
    "heads_float": ("supported_head_sizes", (64.0,), "these entries are not: [64.0]"),
    "priority_bool": ("priority", True, "`priority` must be an int"),
    "priority_float": ("priority", 1.0, "got float 1.0: did you mean 1?"),
    "flag_str": ("supports_sliding_window", "no", "`supports_sliding_window` must be True or"),
    "flag_int": ("mla_only", 1, "`mla_only` must be True or False, got int 1"),
    "cudagraph_int": ("cudagraph_support", 2, "must be a pagedcore.CudaGraphSupport member"),
    "raises": ("supported_dtypes", Raising(RuntimeError("lazy import failed")),
               "reading `supported_dtypes` raised RuntimeError: lazy import failed"),
    "raises_exit": ("supported_head_sizes", Raising(SystemExit(4)),
                    "reading `supported_head_sizes` raised SystemExit: 4"),
    "available_exit": ("is_available", _exiting_classmethod("is_available"),
                       "is_available() raised SystemExit: is_available says bye"),
    "builder_exit": ("get_builder_cls", _exiting_classmethod("get_builder_cls"),
                     "get_builder_cls() raised SystemExit: get_builder_cls says bye"),
}


def _bad_backend(key: str) -> type[Any]:
    attr, value, _ = BAD_DECLARATIONS[key]
    return make_backend(f"bad_{key}", **{attr: value})


@pytest.mark.parametrize("key", sorted(BAD_DECLARATIONS))
def test_bad_declaration_is_a_recorded_failure(registry: BackendRegistry, key: str) -> None:
    good = make_backend("good")
    with pytest.warns(PluginLoadWarning):
        registry.register_plugin(make_plugin(_bad_backend(key), good), name="p")
    assert list(registry.backends) == ["good"]
    (failure,) = registry.failures
    assert failure.backend == f"bad_{key}"
    assert BAD_DECLARATIONS[key][2] in failure.message
    with pytest.raises(pagedcore.BackendLoadError, match="bad_"):
        registry.get(f"bad_{key}")


def test_good_declarations_still_pass(registry: BackendRegistry) -> None:
    ok = make_backend("ok", head_sizes=[64, 128], supported_dtypes=["float32"])  # lists too
    registry.register_plugin(make_plugin(ok), name="p")
    assert registry.failures == ()


@pytest.mark.parametrize(
    "where", ["import", "hook", "is_available", "validate", "builder", "name"])
def test_system_exit_from_plugin_code_is_contained(
        registry: BackendRegistry, where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    good = make_backend("good")
    if where == "import":
        eps = [FakeEntryPoint("exits", SystemExit(2), FakeDistribution("exit-dist")),
               FakeEntryPoint("good", make_plugin(good), FakeDistribution("good-dist"))]
        monkeypatch.setattr("importlib.metadata.entry_points",
                            lambda **kw: [ep for ep in eps if kw.get("group") == ep.group])
        with pytest.warns(PluginLoadWarning, match="failed with SystemExit: 2"):
            reg = BackendRegistry.from_entry_points(allowlist=None)
        assert list(reg.backends) == ["good"] and reg.failures[0].plugin == "exits"
        return
    if where == "hook":
        @pagedcore.hookimpl
        def pagedcore_register_backends() -> list[Any]:
            raise SystemExit(3)

        plugin: Any = type("P", (), {"pagedcore_register_backends":
                                     staticmethod(pagedcore_register_backends)})
        with pytest.warns(PluginLoadWarning, match="raised SystemExit: 3"):
            registry.register_plugin(plugin, name="p")
        return
    if where == "validate":
        bad = make_backend("bad", validate_configuration=_exiting_classmethod("validate"))
        registry.register_plugin(make_plugin(bad, good), name="p")  # valid at load time
        report = pagedcore.explain_selection(head_size=64, dtype="float32", block_size=16,
                                             device="cpu")
        assert report.chosen == "good"
        (row,) = [r for r in report.rows if r.name == "bad"]
        assert "validate_configuration() raised SystemExit" in row.reasons[0]
        return
    attr = {"is_available": "is_available", "builder": "get_builder_cls", "name": "name"}[where]
    value = Raising(SystemExit(5)) if where == "name" else _exiting_classmethod(attr)
    bad = type("Bad", (make_backend("bad"),), {attr: value})
    with pytest.warns(PluginLoadWarning, match="SystemExit"):
        registry.register_plugin(make_plugin(bad, good), name="p")
    assert list(registry.backends) == ["good"]


def test_keyboard_interrupt_is_not_contained(registry: BackendRegistry) -> None:
    bad = make_backend("bad", is_available=classmethod(lambda cls: (_ for _ in ()).throw(
        KeyboardInterrupt())))
    with pytest.raises(KeyboardInterrupt):
        registry.register_plugin(make_plugin(bad), name="p")


class ExitBuilder(MetadataBuilder[None]):
    def build(self, common: Any, *, common_prefix_len: int = 0) -> None:
        return None


@pytest.fixture
def hostile_world(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The real installed plugins plus one fake distribution per kind of bad plugin."""
    original = metadata.entry_points
    real = list(original(group=ENTRY_POINT_GROUP))
    fakes = [
        FakeEntryPoint(f"bad_{key}", make_plugin(_bad_backend(key)),
                       FakeDistribution(f"bad-{key}"))
        for key in sorted(BAD_DECLARATIONS)
    ]
    fakes.append(FakeEntryPoint("exit_at_import", SystemExit(1), FakeDistribution("exit-dist")))
    fakes.append(FakeEntryPoint("raise_at_import", ImportError("no libfoo"),
                                FakeDistribution("import-dist")))

    def entry_points(**kwargs: Any) -> Any:
        if kwargs.get("group") != ENTRY_POINT_GROUP:
            return original(**kwargs)  # triton, transformers... look up their own groups
        return [*real, *fakes]

    monkeypatch.setattr("importlib.metadata.entry_points", entry_points)
    get_registry(reload=True)
    yield
    monkeypatch.undo()
    get_registry(reload=True)


def test_cli_keeps_working_with_every_bad_plugin(hostile_world: None) -> None:
    runner = CliRunner()
    result = runner.invoke(main, ["backends", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)  # valid JSON whatever is installed
    assert data["schema_version"] == 1
    assert "reference" in [b["name"] for b in data["backends"]]
    failed = {f["plugin"] for f in data["failed_plugins"]}
    assert {f"bad_{k}" for k in BAD_DECLARATIONS} | {"exit_at_import", "raise_at_import"} <= failed

    result = runner.invoke(main, ["backends"])
    assert result.exit_code == 0, result.output
    assert "exit_at_import" in result.stdout and "reference" in result.stdout
    assert "PluginLoadWarning" not in result.stderr

    result = runner.invoke(main, ["select", "--head-size", "64", "--dtype", "float32",
                                  "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "chosen:" in result.stdout
    assert "PluginLoadWarning" not in result.stderr  # no noise outside `backends`

    result = runner.invoke(main, ["demo", "--num-requests", "2", "--device", "cpu",
                                  "--backend", "reference"])
    assert result.exit_code == 0, result.output
    assert "pagedcore demo" in result.stdout


def test_llm_reference_works_with_every_bad_plugin(hostile_world: None) -> None:
    llm = pagedcore.LLM("demo", device="cpu", backend="reference", max_model_len=64)
    (out,) = llm.generate(["hi"], pagedcore.SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 2


def test_plugin_failures_are_logged_once(
        registry: BackendRegistry, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("WARNING", logger="pagedcore.plugins")
    bad = make_backend("bad", supported_dtypes=None)
    for name in ("p1", "p2"):
        with pytest.warns(PluginLoadWarning):
            registry.register_plugin(make_plugin(bad), name=name)
    records = [r for r in caplog.records if r.name == "pagedcore.plugins"]
    assert len(records) == 2 and "p1" in records[0].getMessage()  # one per distinct failure
    registry.unregister_plugin("p1")
    registry.register_plugin(make_plugin(bad), name="p1")  # same failure again: not repeated
    assert len([r for r in caplog.records if r.name == "pagedcore.plugins"]) == 2


def test_backends_table_fits_100_columns(registry: BackendRegistry) -> None:
    long_reason = "needs libfancy " + "x" * 150 + "; install it with pip install libfancy"
    slow = make_backend("slow_one", head_sizes=list(range(8, 264, 8)),
                        is_available=classmethod(lambda cls: long_reason),
                        supports_sliding_window=True, supports_alibi=True,
                        supports_logits_soft_cap=True,
                        cudagraph_support=pagedcore.CudaGraphSupport.UNIFORM_BATCH)
    registry.register_plugin(make_plugin(slow), name="fancy", distribution="pagedcore-fancy")
    with pytest.warns(PluginLoadWarning):
        registry.register_plugin(make_plugin(make_backend("b", supported_dtypes="x" * 200)),
                                 name="broken")
    result = CliRunner().invoke(main, ["backends"])
    assert result.exit_code == 0, result.output
    assert max(len(line) for line in result.stdout.splitlines()) <= 100
    assert "x" * 150 not in result.stdout.replace("\n", "")
    verbose = CliRunner().invoke(main, ["backends", "--verbose"]).stdout
    assert "x" * 40 in verbose and "pagedcore-fancy" in verbose

