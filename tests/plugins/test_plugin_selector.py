"""Selector: priority order, forcing, errors listing every backend, cache invalidation."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from plugin_fakes import make_backend, make_plugin

import pagedcore
from pagedcore.attention import AttentionConfig, MultipleOf
from pagedcore.plugins.errors import BackendLoadError, UnknownBackendError
from pagedcore.plugins.registry import BackendRegistry, PluginLoadWarning
from pagedcore.plugins.selector import (
    BackendSelectionError,
    explain_selection,
    make_config,
    select_backend,
)

CPU = {"head_size": 64, "dtype": "float32", "block_size": 16, "device": "cpu"}

SLOW_CPU = make_backend("slow_cpu", priority=50)
FAST_GPU = make_backend("fast_gpu", priority=1, devices=("cuda",), head_sizes=(64, 128),
                        block_sizes=(16, 32))
MID_A = make_backend("mid_a", priority=20, head_sizes=(64, 128), block_sizes=(MultipleOf(16),))
MID_B = make_backend("mid_b", priority=20, supported_dtypes=("bfloat16",))


@pytest.fixture
def four(registry: BackendRegistry) -> BackendRegistry:
    registry.register_plugin(make_plugin(SLOW_CPU, FAST_GPU, MID_A, MID_B), name="four",
                             distribution="fake-four", version="4.0")
    return registry


def test_lowest_priority_valid_backend_wins(four: BackendRegistry) -> None:
    assert select_backend(**CPU) is MID_A  # fast_gpu is cuda-only; mid_b lacks float32
    assert select_backend(**{**CPU, "dtype": "bfloat16"}) is MID_A  # tie 20/20: name order
    assert select_backend(**{**CPU, "head_size": 96}) is SLOW_CPU  # mid_a: 64/128 only
    assert select_backend(**{**CPU, "block_size": 8}) is SLOW_CPU  # mid_a: multiples of 16
    assert pagedcore.select_backend(**CPU) is MID_A  # the top-level lazy export


def test_report_rows_are_ordered_and_explain(four: BackendRegistry) -> None:
    report = explain_selection(**CPU)
    assert [r.name for r in report.rows] == ["fast_gpu", "mid_a", "mid_b", "slow_cpu"]
    assert [r.chosen for r in report.rows] == [False, True, False, False]
    fast = report.rows[0]
    assert fast.source == "fake-four 4.0" and fast.priority == 1
    assert any("device 'cpu' not supported" in reason for reason in fast.reasons)
    assert report.rows[3].valid and not report.rows[3].chosen
    assert "* mid_a" in report.format()
    assert report.to_dict()["chosen"] == "mid_a"


def test_forced_backend_is_used_even_with_higher_priority(four: BackendRegistry,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    assert select_backend(**CPU, backend="slow_cpu") is SLOW_CPU
    monkeypatch.setenv("PAGEDCORE_BACKEND", "slow_cpu")
    assert select_backend(**CPU) is SLOW_CPU
    report = explain_selection(**CPU)
    assert report.forced == "slow_cpu" and "PAGEDCORE_BACKEND" in str(report.forced_by)
    assert select_backend(**CPU, backend="mid_a") is MID_A  # the argument beats the env


def test_forced_backend_has_no_fallback(four: BackendRegistry,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(BackendSelectionError) as info:
        select_backend(**CPU, backend="fast_gpu")
    message = str(info.value)
    assert "'fast_gpu' (forced by backend=)" in message
    assert "device 'cpu' not supported" in message
    assert "mid_a, slow_cpu could serve it" in message
    assert info.value.report is not None and info.value.report.chosen is None
    monkeypatch.setenv("PAGEDCORE_BACKEND", "fast_gpu")
    with pytest.raises(BackendSelectionError, match="PAGEDCORE_BACKEND"):
        select_backend(**CPU)


def test_forced_unknown_name_lists_valid_names(four: BackendRegistry) -> None:
    with pytest.raises(UnknownBackendError, match="Did you mean 'mid_a'") as info:
        select_backend(**CPU, backend="mida")
    assert "fast_gpu, mid_a, mid_b, slow_cpu" in str(info.value)


def test_forced_failed_plugin_is_a_chained_error(four: BackendRegistry) -> None:
    def boom() -> None:
        raise OSError("CUDA driver too old")

    class Exploding:
        @staticmethod
        @pagedcore.hookimpl
        def pagedcore_register_backends() -> list[Any]:
            boom()
            return []

    with pytest.warns(PluginLoadWarning):
        four.register_plugin(Exploding(), name="exploding", distribution="pagedcore-exploding")
    with pytest.raises(BackendLoadError) as info:
        select_backend(**CPU, backend="exploding")
    assert isinstance(info.value.__cause__, OSError)
    assert select_backend(**CPU) is MID_A  # unrequested, it does not matter


def test_nothing_valid_lists_every_backend_failures_and_hints(four: BackendRegistry) -> None:
    with pytest.warns(PluginLoadWarning):
        four.register_plugin(make_plugin(object), name="junk", distribution="junk-dist")
    with pytest.raises(BackendSelectionError) as info:
        select_backend(head_size=64, dtype="float16", block_size=16, device="cpu",
                       sliding_window=128)
    message = str(info.value)
    for name in ("fast_gpu", "mid_a", "mid_b", "slow_cpu"):
        assert f"- {name} (priority" in message
    assert message.count("sliding window not supported") == 4
    assert "junk-dist" in message and "failed to load" in message
    assert "sliding_window=None: mid_a, slow_cpu" in message
    assert isinstance(info.value, ValueError)


def test_hint_names_nearest_supported_sizes(registry: BackendRegistry) -> None:
    registry.register_plugin(make_plugin(make_backend("picky", head_sizes=(64, 128, 256),
                                                      block_sizes=(16, 32))), name="p")
    with pytest.raises(BackendSelectionError) as info:
        select_backend(head_size=120, dtype="float32", block_size=24, device="cpu")
    message = str(info.value)
    assert "head size 120 not supported (supports 64, 128, 256)" in message
    assert "block size 24 not supported" in message
    assert "what would work" not in message  # no single change fixes both
    # fix one of the two, and the hint names the other
    with pytest.raises(BackendSelectionError, match="block_size=16: picky"):
        select_backend(head_size=128, dtype="float32", block_size=20, device="cpu")
    with pytest.raises(BackendSelectionError, match="head_size=128: picky"):
        select_backend(head_size=120, dtype="float32", block_size=16, device="cpu")


def test_no_backend_registered(registry: BackendRegistry) -> None:
    with pytest.raises(BackendSelectionError, match="no attention backend is registered"):
        select_backend(**CPU)


def test_cache_notices_new_and_removed_plugins(four: BackendRegistry) -> None:
    assert select_backend(**CPU) is MID_A
    newcomer = make_backend("newcomer", priority=5)
    with four.temporary_plugin(make_plugin(newcomer), name="new"):
        assert select_backend(**CPU) is newcomer
    assert select_backend(**CPU) is MID_A


def test_cache_notices_env_changes(four: BackendRegistry,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    assert select_backend(**CPU) is MID_A
    monkeypatch.setenv("PAGEDCORE_BACKEND", "slow_cpu")
    assert select_backend(**CPU) is SLOW_CPU


def test_validate_configuration_raising_is_a_reason(registry: BackendRegistry) -> None:
    def broken(cls: type, cfg: AttentionConfig) -> list[str]:
        raise KeyError("oops")

    bad = make_backend("bad", priority=0, validate_configuration=classmethod(broken))
    registry.register_plugin(make_plugin(bad, SLOW_CPU), name="p")
    report = explain_selection(**CPU)
    assert report.chosen == "slow_cpu"
    assert "validate_configuration() raised KeyError" in report.rows[0].reasons[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, "bfloat16", "bf16", "torch.bfloat16", "BF16"])
def test_dtype_names_and_torch_dtypes(dtype: Any) -> None:
    assert make_config(head_size=64, dtype=dtype, block_size=16, device="cpu").dtype == "bfloat16"


def test_config_inputs() -> None:
    cfg = make_config(head_size=64, dtype="fp16", block_size=16, kv_cache_dtype="fp8",
                      device=torch.device("cpu"))
    assert (cfg.dtype, cfg.kv_cache_dtype, cfg.device) == ("float16", "fp8_e4m3", "cpu")
    default = make_config(head_size=64, dtype="fp32", block_size=16).device
    assert default == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="dtype 'float64' is not one of"):
        make_config(head_size=64, dtype=torch.float64, block_size=16, device="cpu")
    with pytest.raises(ValueError, match="head_size must be a positive integer"):
        make_config(head_size=0, dtype="fp32", block_size=16, device="cpu")
