"""`pagedcore bench kv` and its trace simulation, on a small trace."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from pagedcore.bench.kv import kv
from pagedcore.bench.kv_trace import (
    TraceParams,
    make_trace,
    simulate_contiguous,
    simulate_paged,
)


def test_trace_is_seeded_and_fits_max_model_len() -> None:
    params = TraceParams(num_requests=200, seed=3, max_model_len=512)
    trace = make_trace(params)
    assert trace == make_trace(params) != make_trace(TraceParams(num_requests=200, seed=4))
    assert all(p >= 1 and o >= 1 and p + o <= 512 for p, o in trace)


def test_paged_packs_tighter_than_contiguous() -> None:
    params = TraceParams(num_requests=150, max_model_len=1024, num_max_len_requests=8)
    trace = make_trace(params)
    paged = simulate_paged(params, trace)
    contiguous = simulate_contiguous(params, trace)
    assert contiguous.max_concurrent == 8
    assert paged.max_concurrent > contiguous.max_concurrent
    # Only the last block of each request is partly empty.
    assert paged.live_fraction > 0.9 > 0.5 > contiguous.live_fraction
    assert paged.steps < contiguous.steps


def test_cli_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "kv.json"
    result = CliRunner().invoke(kv, ["--repeats", "1", "--requests", "40", "--json", str(out)])
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    assert figures["command"].startswith("pagedcore bench kv")
    assert figures["allocate_free"]["manager_ns_per_block"] > 0
    assert figures["trace"]["paged"]["policy"] == "paged"
    assert "reserved slots holding live tokens" in result.output
