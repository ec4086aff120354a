"""Report helpers, the backends normalizer and the bench CLI entries (tiny end-to-end runs)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from pagedcore.bench.backends import normalize_report
from pagedcore.bench.cli import BENCHES, bench
from pagedcore.bench.report import environment, percentiles, write_json

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_percentiles_match_numpy() -> None:
    rng = random.Random(0)
    for n in (1, 2, 7, 100):
        data = [rng.random() for _ in range(n)]
        got = percentiles(data)
        assert got["n"] == n
        for q in (50, 95, 99):
            assert got[f"p{q}"] == pytest.approx(float(np.percentile(data, q)))
    assert percentiles([]) == {"n": 0, "p50": None, "p95": None, "p99": None}


def test_write_json_creates_the_directory(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b.json"
    write_json(str(path), {"x": 1, "when": Path("p")})
    assert json.loads(path.read_text()) == {"x": 1, "when": "p"}


def test_environment_names_device_commit_and_versions() -> None:
    import torch

    env = environment(torch.device("cpu"))
    assert env["device"].startswith("cpu")
    assert {"torch", "transformers", "git_commit", "command"} <= set(env)


def test_normalize_understands_the_three_report_layouts() -> None:
    kernels = {"results": [
        {"case": "decode", "shape": "8x1024", "impl": "sdpa-contiguous(enable_gqa)",
         "kv_GBps": 10.0, "ms": 1.0},
        {"case": "decode", "shape": "8x1024", "impl": "naive-gather+sdpa", "kv_GBps": 1.0},
        {"case": "decode", "shape": "8x1024", "impl": "triton", "kv_GBps": 8.0},
        {"case": "prefill", "shape": "1x512", "impl": "triton", "TFLOPs": 3.0},
        {"case": "prefill", "shape": "1x512", "impl": "broken", "error": "boom"},
        {"case": "mixed", "shape": "x", "impl": "triton", "ms": 1.0},
    ]}
    rows = normalize_report(kernels, source="k.json")
    got = {(r["backend"], r["case"]): r["value"] for r in rows}
    assert got == {("torch SDPA (contiguous)", "decode"): 10.0, ("triton", "decode"): 8.0,
                   ("triton", "prefill"): 3.0}

    cuda = {"decode": [
        {"case": "decode", "batch": 64, "ctx": 4096, "impl": "x/auto", "gbps": 5.0},
        {"case": "decode", "batch": 64, "ctx": 4096, "impl": "x/fast_variant", "gbps": 9.0},
    ], "prefill": [
        {"case": "prefill", "batch": 4, "len": 2048, "impl": "two_lanes_per_row",
         "tflops": 2.0, "sdpa_tflops": 20.0},
        {"case": "prefill", "batch": 4, "len": 2048, "impl": "lane_per_key", "tflops": 1.0},
    ]}
    rows = normalize_report(cuda, source="x_h200.json")
    got = {(r["backend"], r["case"], r["shape"]): (r["value"], r["variant"]) for r in rows}
    assert got == {("x", "decode", "64x4096"): (5.0, "auto"),  # the shipped dispatch wins
                   ("x", "prefill", "4x2048"): (2.0, "two_lanes_per_row"),  # else the fastest
                   ("torch SDPA (contiguous)", "prefill", "4x2048"): (20.0, None)}

    shipped = {"shipped_configuration": [
        {"case": "decode", "shape": "64x4096", "kv_GBps": 7.0},
        {"case": "decode", "shape": "64x4096", "kv_GBps": 7.5},
    ]}
    rows = normalize_report(shipped, source="tri_h200.json")
    assert [(r["backend"], r["value"]) for r in rows] == [("tri", 7.0)]


def test_every_bench_entry_resolves_to_a_click_command() -> None:
    for name in ("prefix", "chunked", "memory", "backends"):
        assert name in BENCHES
        assert bench.get_command(None, name) is not None  # type: ignore[arg-type]


def _run(args: list[str]) -> None:
    result = CliRunner().invoke(bench, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output


def test_memory_cli_writes_json_and_png(tmp_path: Path) -> None:
    kernel = tmp_path / "k.json"
    kernel.write_text(json.dumps({"results": [
        {"backend": "fake", "block_size": b, "kv_GBps": 100.0 / b, "shape": "1x1"}
        for b in (8, 16, 32)]}))
    out, png = tmp_path / "m.json", tmp_path / "m.png"
    _run(["memory", "--budget-mib", "256", "--kernel-json", str(kernel), "--json", str(out),
          "--plot", str(png)])
    report = json.loads(out.read_text())
    assert report["paged"]["max_concurrency"] > report["contiguous"]["max_concurrency"]
    assert [r["block_size"] for r in report["block_size_sweep"]] == [8, 16, 32, 64, 128, 256]
    assert report["kernel_speed"]["source"] == str(kernel)
    assert {"environment", "model", "engine_config", "warmup", "repetitions"} <= set(report)
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_backends_cli_plots_committed_reports(tmp_path: Path) -> None:
    reports = Path(__file__).resolve().parents[2] / "docs" / "benchmarks"
    sources = [str(p) for p in (reports / "triton_h200.json", reports / "cuda_paged_h200.json")
               if p.exists()]
    if not sources:
        pytest.skip(f"no committed kernel reports in {reports}")
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    args = ["backends", "--json", str(out), "--plot", str(png)]
    for s in sources:
        args += ["--from-json", s]
    _run(args)
    report = json.loads(out.read_text())
    assert {r["case"] for r in report["rows"]} == {"decode", "prefill"}
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_backends_cli_live_at_other_heads(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """``--heads`` / ``--head-size`` reach the live measurement and the report's caption
    field; with ``--from-json`` they are a usage error (the reports carry their own)."""
    from pagedcore.bench import kernels
    from pagedcore.bench.backends import report_heads

    measured = []
    real = kernels.bench_uniform

    def spy(*args: object, **kwargs: object) -> object:
        measured.append(kwargs.get("heads"))
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(kernels, "bench_uniform", spy)
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    _run(["backends", "--small", "--backend", "reference", "--heads", "14/2", "--head-size",
          "64", "--json", str(out), "--plot", str(png)])
    report = json.loads(out.read_text())
    assert measured and set(measured) == {kernels.HeadShape(14, 2, 64)}
    assert report["heads"] == "14 q / 2 KV heads, head 64"
    assert {(r["case"], r["backend"]) for r in report["rows"]} >= {
        ("decode", "reference"), ("prefill", "reference")}
    assert png.read_bytes()[:8] == PNG_MAGIC
    kernels_json = tmp_path / "k.json"
    kernels_json.write_text(json.dumps({"config": {"num_heads": 14, "num_kv_heads": 2,
                                                   "head_size": 64}, "results": []}))
    assert report_heads(json.loads(kernels_json.read_text())) == "14 q / 2 KV heads, head 64"
    assert report_heads({"results": []}) == "32 q / 8 KV heads, head 128"
    res = CliRunner().invoke(bench, ["backends", "--from-json", str(kernels_json), "--heads",
                                     "14/2"])
    assert res.exit_code == 2 and "carry their own" in res.output, res.output


def test_prefix_cli_small_end_to_end(tmp_path: Path) -> None:
    out, png = tmp_path / "p.json", tmp_path / "p.png"
    _run(["prefix", "--small", "--device", "cpu", "--lengths", "48,96", "--reps", "1",
          "--json", str(out), "--plot", str(png)])
    report = json.loads(out.read_text())
    assert all(r["hits_proven"] for r in report["shared_system_prompt"])
    assert report["engine_config"]["enable_prefix_caching"] is True
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_chunked_cli_small_end_to_end(tmp_path: Path) -> None:
    out, png = tmp_path / "c.json", tmp_path / "c.png"
    _run(["chunked", "--small", "--device", "cpu", "--long-len", "256", "--reps", "1",
          "--json", str(out), "--plot", str(png)])
    report = json.loads(out.read_text())
    labels = [r["label"] for r in report["configs"]]
    assert labels[0] == "no chunking" and len(labels) == 9
    assert all(r["unfinished"] == 0 for r in report["configs"])
    assert all(r["short_ttft_s"]["n"] == 20 for r in report["configs"])
    assert png.read_bytes()[:8] == PNG_MAGIC
