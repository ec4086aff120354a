"""Plugin code that misbehaves past registration, or calls back in while it loads: contained
and named, never a deadlock, a traceback or a garbled reason."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from plugin_fakes import (
    FakeDistribution,
    FakeEntryPoint,
    install_entry_points,
    make_backend,
    make_plugin,
)

import pagedcore
from pagedcore.plugins.errors import BackendSetupError
from pagedcore.plugins.registry import BackendRegistry, PluginLoadWarning, get_registry
from pagedcore.reference import ReferenceBackend


def test_a_plugin_calling_back_in_while_the_registry_loads_fails_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Its hook selects a backend (the registry is loading, on this thread): that plugin is
    recorded as failed, the others load, and nothing waits for itself."""

    @pagedcore.hookimpl
    def pagedcore_register_backends() -> list[Any]:
        pagedcore.select_backend(head_size=64, dtype="float32", block_size=16, device="cpu")
        return [make_backend("never")]

    reentrant = type("Plugin", (), {"pagedcore_register_backends":
                                    staticmethod(pagedcore_register_backends)})()
    install_entry_points(
        monkeypatch,
        FakeEntryPoint("reentrant", reentrant, FakeDistribution("reentrant-dist")),
        FakeEntryPoint("good", make_plugin(make_backend("good")), FakeDistribution("good-dist")))
    done: list[BackendRegistry] = []
    with pytest.warns(PluginLoadWarning, match="while the registry was loading"):
        worker = threading.Thread(target=lambda: done.append(get_registry(reload=True)))
        worker.start()
        worker.join(timeout=60)
    assert done, "get_registry() deadlocked"
    (reg,) = done
    assert list(reg.backends) == ["good"]
    assert [f.plugin for f in reg.failures] == ["reentrant"]
    monkeypatch.undo()
    get_registry(reload=True)


@pytest.mark.parametrize("returned", ["needs CUDA", "", None, [3]])
def test_validate_configuration_must_return_a_list_of_reasons(
        registry: BackendRegistry, returned: Any) -> None:
    """A bare str is not a list of one-character reasons, nor is "" "no reason"."""
    odd = make_backend("odd", priority=1, validate_configuration=classmethod(
        lambda cls, cfg: returned))
    registry.register_plugin(make_plugin(odd, make_backend("plain", priority=2)), name="p")
    report = pagedcore.explain_selection(head_size=64, dtype="float32", block_size=16,
                                         device="cpu")
    row = next(r for r in report.rows if r.name == "odd")
    assert not row.valid
    (reason,) = row.reasons
    assert "must return a list of str" in reason
    assert report.chosen == "plain"


@pytest.mark.parametrize(("attr", "value", "message"), [
    ("name", "foo\n", "name must be a non-empty string"),  # ($ matched before the newline)
    ("priority", -10**30, "within"),
    ("is_available", classmethod(lambda cls: ""), "a non-empty str"),
])
def test_declarations_that_passed_before_are_refused(
        registry: BackendRegistry, attr: str, value: Any, message: str) -> None:
    bad = make_backend(value) if attr == "name" else make_backend("bad", **{attr: value})
    with pytest.warns(PluginLoadWarning):
        registry.register_plugin(make_plugin(bad, make_backend("good")), name="p")
    assert list(registry.backends) == ["good"]
    (failure,) = registry.failures
    assert message in failure.message


class _TooSmallCache(ReferenceBackend):
    name = "too_small_cache"

    @classmethod
    def get_kv_cache_shape(cls, num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int, cache_dtype: str = "auto") -> tuple[int, ...]:
        return (2, num_blocks, block_size)  # missing the heads and the head size


class _NoShape(ReferenceBackend):
    name = "no_shape"

    @classmethod
    def get_kv_cache_shape(cls, *args: Any, **kwargs: Any) -> Any:
        return "garbage"


class _FailingImpl(ReferenceBackend.get_impl_cls()):  # type: ignore[misc]
    def setup(self) -> None:
        raise RuntimeError("cannot create the kernel handle")


class _ImplFails(ReferenceBackend):
    name = "impl_fails"

    @classmethod
    def get_impl_cls(cls) -> Any:
        return _FailingImpl


@pytest.mark.parametrize(("backend", "message"), [
    (_TooSmallCache, "fewer than the"),
    (_NoShape, "not a tuple of positive ints"),
    (_ImplFails, "building the impl of layer 0 raised RuntimeError: cannot create"),
])
def test_a_backend_failing_at_engine_setup_is_named_with_its_distribution(
        registry: BackendRegistry, backend: type[Any], message: str) -> None:
    registry.register_plugin(make_plugin(backend), name="p", distribution="fancy-attn",
                             version="0.3")
    with pytest.raises(BackendSetupError) as info:
        pagedcore.LLM("demo", device="cpu", backend=backend.name, max_model_len=64)
    text = str(info.value)
    assert f"backend {backend.name!r} (fancy-attn 0.3)" in text and message in text
    assert isinstance(info.value, ValueError)  # the CLI's usage error, not a traceback


def test_a_broken_plugin_is_not_repeated_on_the_stderr_of_every_command(
        tmp_path: Path) -> None:
    """A real distribution (a dist-info on the path) whose plugin fails at import: listed by
    `pagedcore backends`, silent in other commands (docs/plugin-guide.md)."""
    site = tmp_path / "site"
    info = site / "brokenplug_dist-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: brokenplug-dist\n"
                                   "Version: 1.0\n")
    (info / "entry_points.txt").write_text("[pagedcore.backends]\nbrokenplug = brokenplug_mod\n")
    (site / "brokenplug_mod.py").write_text("raise ImportError('no libbroken here')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(site), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("PAGEDCORE_PLUGINS", None)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pagedcore", *args], env=env,
                              capture_output=True, text=True, timeout=300, check=False)

    select = run("select", "--head-size", "64", "--dtype", "float32", "--device", "cpu")
    assert select.returncode == 0 and "chosen:" in select.stdout, select.stderr
    assert "brokenplug" not in select.stderr
    listed = run("backends")
    assert listed.returncode == 0 and "brokenplug" in listed.stdout
