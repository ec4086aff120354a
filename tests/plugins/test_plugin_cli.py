"""`pagedcore backends` and `pagedcore select` through click's CliRunner."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from plugin_fakes import make_backend, make_plugin

from pagedcore.attention import CudaGraphSupport
from pagedcore.cli import main
from pagedcore.plugins.registry import BackendRegistry, PluginLoadWarning

GPU_ONLY = make_backend("gpu_only", priority=5, devices=("cuda",), head_sizes=(64, 128),
                        supports_sliding_window=True,
                        supported_kv_cache_dtypes=("auto", "fp8_e4m3", "fp8_e5m2"),
                        cudagraph_support=CudaGraphSupport.UNIFORM_BATCH)
CPU_ONE = make_backend("cpu_one", priority=50)


@pytest.fixture
def populated(registry: BackendRegistry) -> BackendRegistry:
    registry.register_plugin(make_plugin(GPU_ONLY, CPU_ONE), name="fakes",
                             distribution="pagedcore-fakes", version="0.9")
    with pytest.warns(PluginLoadWarning):
        registry.register_plugin(make_plugin(make_backend("")), name="broken_plugin",
                                 distribution="broken-dist", version="6.6")
    return registry


def test_backends_table(populated: BackendRegistry) -> None:
    result = CliRunner().invoke(main, ["backends"])
    assert result.exit_code == 0, result.output
    out = result.output
    for needle in ("gpu_only", "cpu_one", "sw", "fp8:e4m3/e5m2", "graph:uniform", "64, 128", "any",
                   "failed to load", "broken_plugin", "broken-dist 6.6"):
        assert needle in out, needle
    assert out.index("gpu_only") < out.index("cpu_one")  # priority order
    assert max(map(len, out.splitlines())) <= 100  # fits a 100-column terminal
    verbose = CliRunner().invoke(main, ["backends", "--verbose"]).output
    for needle in ("pagedcore-fakes 0.9", "sliding_window", "cudagraph:uniform_batch",
                   "auto, fp8_e4m3, fp8_e5m2"):
        assert needle in verbose, needle


def test_backends_json(populated: BackendRegistry) -> None:
    result = CliRunner().invoke(main, ["backends", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert [b["name"] for b in data["backends"]] == ["gpu_only", "cpu_one"]
    gpu = data["backends"][0]
    assert gpu["devices"] == ["cuda"] and gpu["head_sizes"] == [64, 128]
    assert gpu["distribution"] == "pagedcore-fakes" and gpu["version"] == "0.9"
    assert gpu["unavailable_reason"] is None
    (failed,) = data["failed_plugins"]
    assert failed["plugin"] == "broken_plugin" and "name must be" in failed["message"]


def test_select_success(populated: BackendRegistry) -> None:
    result = CliRunner().invoke(
        main, ["select", "--head-size", "128", "--dtype", "bfloat16", "--block-size", "16",
               "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "chosen: cpu_one" in result.output
    assert "device 'cpu' not supported" in result.output  # gpu_only's reason is explained


def test_select_json_and_forced(populated: BackendRegistry, cuda_here: None) -> None:
    result = CliRunner().invoke(
        main, ["select", "--head-size", "64", "--device", "cuda", "--backend", "cpu_one",
               "--json"])
    assert result.exit_code == 1  # cpu_one cannot run on cuda and forcing has no fallback
    data = json.loads(result.output[: result.output.rindex("}") + 1])
    assert data["chosen"] is None and data["forced"] == "cpu_one"
    assert "gpu_only could serve it" in result.output


def test_select_failure_exits_1_with_reasons(populated: BackendRegistry) -> None:
    result = CliRunner().invoke(
        main, ["select", "--head-size", "64", "--device", "cpu", "--alibi"])
    assert result.exit_code == 1
    assert "no attention backend can serve" in result.output
    assert "ALiBi not supported" in result.output
    assert "use_alibi=False: cpu_one" in result.output


def test_select_bad_input_is_a_usage_error(populated: BackendRegistry) -> None:
    runner = CliRunner()
    result = runner.invoke(main, ["select", "--head-size", "64", "--dtype", "float64"])
    assert result.exit_code == 2 and "dtype 'float64' is not one of" in result.output
    result = runner.invoke(main, ["select", "--head-size", "0"])
    assert result.exit_code == 2 and "head_size must be a positive integer" in result.output
    result = runner.invoke(main, ["select", "--head-size", "64", "--backend", "cpu_on"])
    assert result.exit_code == 2 and "Did you mean 'cpu_one'" in result.output
    result = runner.invoke(main, ["select", "--head-size", "64", "--backend", "broken_plugin"])
    assert result.exit_code == 2 and "caused by BackendValidationError" in result.output


def test_select_explain_gives_each_valid_backend_its_measurement(
        registry: BackendRegistry) -> None:
    """`select --explain`: the valid backends in priority order, the chosen one marked, each
    with its `priority_reason` (or that none was recorded); JSON carries the reason too."""
    fast = make_backend("fast_one", priority=10,
                        priority_reason="fastest in bench engine (docs/benchmarks/x.json)")
    registry.register_plugin(make_plugin(fast, CPU_ONE, GPU_ONLY), name="fakes")
    args = ["select", "--head-size", "64", "--device", "cpu"]
    out = CliRunner().invoke(main, [*args, "--explain"]).output
    tail = out[out.index("why this order"):]
    assert "* fast_one (priority 10): fastest in bench engine (docs/benchmarks/x.json)" in tail
    assert "- cpu_one (priority 50): no measurement recorded" in tail
    assert "gpu_only" not in tail  # cannot serve cpu, so it is not in the order
    assert "why this order" not in CliRunner().invoke(main, args).output
    data = json.loads(CliRunner().invoke(main, [*args, "--json"]).output)
    reasons = {b["name"]: b["priority_reason"] for b in data["backends"]}
    assert reasons["fast_one"].startswith("fastest in bench engine") and not reasons["cpu_one"]


def test_a_priority_reason_that_is_not_a_sentence_is_refused(registry: BackendRegistry) -> None:
    bad = make_backend("bad_reason", priority_reason=42)
    with pytest.warns(PluginLoadWarning):
        registry.register_plugin(make_plugin(bad), name="bad")
    (failure,) = registry.failures
    assert "`priority_reason` must be None or a non-empty sentence" in failure.describe()
