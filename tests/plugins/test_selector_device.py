"""Selection checks that the asked-for device exists here: ``device="cuda"`` without CUDA fails.

``torch.cuda.is_available`` is replaced per test (fixtures `no_cuda` / `cuda_here` in
conftest.py), so these run the same on CPU and GPU machines.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from click.testing import CliRunner
from plugin_fakes import make_backend, make_plugin

from pagedcore.cli import main
from pagedcore.plugins.registry import BackendRegistry
from pagedcore.plugins.selector import (
    NO_CUDA_REASON,
    BackendSelectionError,
    explain_selection,
    select_backend,
)

GPU = make_backend("gpu_fast", priority=1, devices=("cuda",))
BOTH = make_backend("both", priority=50, devices=("cpu", "cuda"))
CPU_ONLY = make_backend("cpu_only", priority=90, devices=("cpu",), head_sizes=(64,))
CUDA_CFG: dict[str, Any] = {"head_size": 64, "dtype": "float16", "block_size": 16,
                            "device": "cuda"}


@pytest.fixture
def three(registry: BackendRegistry) -> BackendRegistry:
    registry.register_plugin(make_plugin(GPU, BOTH, CPU_ONLY), name="three")
    return registry


def test_cuda_without_a_device_is_refused_by_every_backend(
    three: BackendRegistry, no_cuda: None
) -> None:
    report = explain_selection(**CUDA_CFG)
    assert report.chosen is None
    assert [r.name for r in report.rows] == ["gpu_fast", "both", "cpu_only"]
    for row in report.rows:
        assert row.reasons[0] == NO_CUDA_REASON, row
    # the backends' own reasons are still listed after it
    cpu_only = next(r for r in report.rows if r.name == "cpu_only")
    assert any("device 'cuda' not supported" in why for why in cpu_only.reasons)
    with pytest.raises(BackendSelectionError, match=NO_CUDA_REASON) as info:
        select_backend(**CUDA_CFG)
    assert info.value.report is not None and info.value.report.chosen is None


def test_cuda_with_a_device_is_served(three: BackendRegistry, cuda_here: None) -> None:
    assert select_backend(**CUDA_CFG) is GPU
    report = explain_selection(**CUDA_CFG)
    assert all(NO_CUDA_REASON not in r.reasons for r in report.rows)


def test_availability_is_asked_at_call_time_not_cached(
    three: BackendRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert select_backend(**CUDA_CFG) is GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # no cache clearing
    with pytest.raises(BackendSelectionError, match=NO_CUDA_REASON):
        select_backend(**CUDA_CFG)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert select_backend(**CUDA_CFG) is GPU


def test_forced_backend_on_missing_cuda_says_why(three: BackendRegistry, no_cuda: None) -> None:
    with pytest.raises(BackendSelectionError, match=f"'both'.*{NO_CUDA_REASON}"):
        select_backend(**CUDA_CFG, backend="both")


def test_cpu_is_unaffected(three: BackendRegistry, no_cuda: None) -> None:
    report = explain_selection(**{**CUDA_CFG, "device": "cpu"})
    assert report.chosen == "both"
    assert all(NO_CUDA_REASON not in r.reasons for r in report.rows)


def test_hints_offer_cuda_only_where_it_exists(
    three: BackendRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a sliding window on cpu: nothing fits; only cuda_window would, on cuda, and the hint
    # says so only when there is a CUDA device.
    cfg = {**CUDA_CFG, "device": "cpu", "head_size": 96, "sliding_window": 8}
    fits_cuda = make_backend("cuda_window", priority=5, devices=("cuda",),
                             supports_sliding_window=True)
    three.register_plugin(make_plugin(fits_cuda), name="cuda_window")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not any(h.startswith("device=cuda") for h in explain_selection(**cfg).hints)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "device=cuda: cuda_window" in explain_selection(**cfg).hints


def test_select_cli_device_cuda_without_cuda(three: BackendRegistry, no_cuda: None) -> None:
    result = CliRunner().invoke(main, ["select", "--head-size", "64", "--device", "cuda"])
    assert result.exit_code == 1
    assert "no attention backend can serve" in result.output
    rows = [line for line in result.output.splitlines() if "(priority " in line]
    assert len(rows) == 3 and all(NO_CUDA_REASON in line for line in rows), result.output
    assert "device=cpu: both, cpu_only" in result.output  # what would work instead


def test_triton_interpreter_still_serves_cpu(
    registry: BackendRegistry, no_cuda: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    plugin = pytest.importorskip("pagedcore_triton.plugin")
    from pagedcore.reference import plugin as reference_plugin

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    registry.register_plugin(reference_plugin, name="reference")
    registry.register_plugin(plugin, name="triton")
    cfg: dict[str, Any] = {"head_size": 64, "dtype": "float32", "block_size": 16}
    assert explain_selection(**cfg, device="cpu").chosen == "triton"
    report = explain_selection(**cfg, device="cuda")
    assert report.chosen is None
    assert {"reference", "triton"} <= {r.name for r in report.rows}
    assert all(r.reasons[0] == NO_CUDA_REASON for r in report.rows)
