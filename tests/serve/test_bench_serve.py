"""`pagedcore bench serve` against the live test server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from serve_helpers import LiveServer

from pagedcore.bench.cli import bench
from pagedcore.bench.serve import RequestResult, make_workload, summarize


def test_bench_serve_runs_and_reports(demo_server: LiveServer, tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    args = ["serve", "--base-url", demo_server.url, "--num-requests", "12",
            "--request-rate", "200,inf", "--input-len", "8:24", "--output-len", "3:6",
            "--shared-prefix-len", "6", "--shared-prefix-fraction", "0.5",
            "--max-concurrency", "6", "--slo-ttft-ms", "60000", "--json", str(out),
            "--plot", str(tmp_path / "serve.png"), "--no-progress"]
    result = CliRunner().invoke(bench, args)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["model"] == "m"  # found through /v1/models
    work = make_workload(12, input_len=(8, 24), output_len=(3, 6), seed=0,
                         shared_prefix_len=6, shared_prefix_fraction=0.5)
    assert [r["request_rate"] for r in report["runs"]] == [200.0, "inf"]
    for run in report["runs"]:
        s = run["summary"]
        assert (s["completed"], s["errors"]) == (12, 0)
        # ignore_eos: every request generated exactly what it asked for, counted from usage.
        assert s["output_tokens"] == sum(w.output_len for w in work)
        assert s["prompt_tokens"] == sum(w.prompt_len for w in work)
        assert s["goodput"] == s["request_throughput"]  # a loose SLO: every request meets it
        assert 0 < s["ttft_ms"]["p50"] <= s["ttft_ms"]["p99"] <= s["e2e_ms"]["p99"]
    assert "req/s" in result.output
    assert (tmp_path / "serve.png").read_bytes()[:4] == b"\x89PNG"


def test_summarize_percentiles_and_goodput() -> None:
    results = [RequestResult(ok=True, ttft=t, e2e=t + 0.1 * 10, output_tokens=11,
                             prompt_tokens=5, itl=[0.1] * 10) for t in (0.1, 0.2, 0.3, 2.0)]
    results.append(RequestResult(ok=False, error="HTTP 503: full"))
    s = summarize(results, 2.0, slo_ttft_ms=500, slo_tpot_ms=150)
    assert (s["completed"], s["errors"], s["error_samples"]) == (4, 1, ["HTTP 503: full"])
    assert s["ttft_ms"]["p50"] == pytest.approx(250.0)  # numpy's linear interpolation
    assert s["tpot_ms"]["p99"] == pytest.approx(100.0)
    assert s["goodput"] == pytest.approx(3 / 2.0)  # the 2 s TTFT misses the SLO
    assert s["output_throughput"] == pytest.approx(44 / 2.0)


def test_bench_serve_counts_errors(demo_server: LiveServer, tmp_path: Path) -> None:
    out = tmp_path / "err.json"
    result = CliRunner().invoke(bench, [
        "serve", "--base-url", demo_server.url, "--model", "no-such-model",
        "--num-requests", "3", "--input-len", "4", "--output-len", "2", "--json", str(out),
        "--no-progress"])
    assert result.exit_code == 0, result.output
    s = json.loads(out.read_text())["runs"][0]["summary"]
    assert (s["completed"], s["errors"]) == (0, 3)
    assert "HTTP 404" in s["error_samples"][0]


def test_bench_serve_workers_split_and_merge(demo_server: LiveServer) -> None:
    """--num-workers: the load in several client processes, every request accounted for
    once, in workload order."""
    from pagedcore.bench.serve_workers import run_load_workers

    work = make_workload(9, input_len=(8, 16), output_len=(2, 5), seed=3)
    results, duration = run_load_workers(work, num_workers=2, base_url=demo_server.url,
                                         model="m", request_rate=300.0)
    assert all(r.ok for r in results), [r.error for r in results]
    assert [r.output_tokens for r in results] == [w.output_len for w in work]
    assert [r.prompt_tokens for r in results] == [w.prompt_len for w in work]
    starts = sorted(r.start for r in results)
    assert 0 < max(r.start + (r.e2e or 0) for r in results) - starts[0] <= duration


def test_bench_client_chat_and_api_key(chat_server: LiveServer) -> None:
    """The load generator's chat path (text prompts through the chat template) and its
    bearer key: without the key every request is a 401, recorded as an error."""
    import asyncio

    from serve_helpers import DEMO_KW

    from pagedcore.bench.serve_load import WorkItem, run_load

    work = [WorkItem(prompt=f"hello there number {i}", prompt_len=0, output_len=3)
            for i in range(4)]
    results, _ = asyncio.run(run_load(work, base_url=chat_server.url, model="m",
                                      endpoint="chat"))
    assert all(r.ok for r in results), [r.error for r in results]
    assert [r.output_tokens for r in results] == [3] * 4
    assert all(r.ttft is not None and r.prompt_tokens > 5 for r in results)

    keyed = LiveServer("demo", api_key="sesame", **DEMO_KW)
    try:
        ids = [WorkItem(prompt=[5, 6, 7, 8], prompt_len=4, output_len=2)] * 2
        ok, _ = asyncio.run(run_load(ids, base_url=keyed.url, model="m", api_key="sesame"))
        refused, _ = asyncio.run(run_load(ids, base_url=keyed.url, model="m"))
    finally:
        keyed.stop()
    assert [r.ok for r in ok] == [True, True] and ok[0].output_tokens == 2
    assert [r.ok for r in refused] == [False, False]
    assert refused[0].error is not None and refused[0].error.startswith("HTTP 401")
