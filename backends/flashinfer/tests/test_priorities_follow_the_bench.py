"""Selection follows measurement (issue #21): the in-tree backends that the engine bench ran
side by side are ordered by priority exactly as by their measured tokens/s, and every
benchmark file a `priority_reason` cites is committed."""

from __future__ import annotations

import glob
import json
import pathlib
import re

import pytest

from pagedcore.plugins.registry import get_registry

ROOT = pathlib.Path(__file__).resolve().parents[3]
ENGINE = ROOT / "docs" / "benchmarks" / "h200_s12_fi" / "round2"


def _tok_s(name: str) -> float:
    return float(json.loads((ENGINE / f"engine_{name}.json").read_text())["pagedcore_tok_s"])


def test_priorities_order_the_engine_bench() -> None:
    registry = get_registry()
    measured = {n: _tok_s(n) for n in ("triton", "cuda_paged", "flashinfer")}
    by_speed = sorted(measured, key=measured.__getitem__, reverse=True)
    by_priority = sorted(measured, key=lambda n: registry.get(n).priority)
    assert by_priority == by_speed, (measured, by_priority)


@pytest.mark.parametrize("name", ["triton", "cuda_paged", "flashinfer", "flashinfer_mla",
                                  "triton_mla", "flex"])
def test_cited_benchmark_files_exist(name: str) -> None:
    reason = get_registry().get(name).priority_reason or ""
    for path in re.findall(r"docs/benchmarks/[\w./*-]+\w", reason):
        assert glob.glob(str(ROOT / path)), f"{name} cites {path}, which is not committed"


def test_the_reasons_quote_the_committed_figures() -> None:
    registry = get_registry()
    figures = [f"{round(_tok_s(n)):,}" for n in ("triton", "cuda_paged", "flashinfer")]
    for name in ("triton", "cuda_paged", "flashinfer"):
        reason = registry.get(name).priority_reason or ""
        assert all(f in reason for f in figures), (name, figures)
