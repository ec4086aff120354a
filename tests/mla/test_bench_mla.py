"""`pagedcore bench mla`: the capacity figures and the CLI on CPU."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from pagedcore.bench.mla import MODELS, capacity_rows, mla


def test_bytes_per_token_and_concurrency() -> None:
    lite = MODELS[0]
    # 27 layers x (512 + 64) bf16 values vs 27 x 16 heads x (192 K + 128 V) bf16 values.
    assert lite.mla_bytes_per_token() == 27 * 576 * 2 == 31104
    assert lite.decompressed_bytes_per_token() == 27 * 16 * 320 * 2 == 276480
    row = capacity_rows(40.0, 4096)[0]
    assert row["mla_max_requests"] == (40 << 30) // (4096 * 31104) == 337
    assert row["decompressed_max_requests"] == (40 << 30) // (4096 * 276480) == 37
    # An fp8 latent cache: one byte per element, twice the requests.
    assert lite.mla_bytes_per_token("float8_e4m3fn") == 27 * 576 == 15552
    assert row["mla_fp8_max_requests"] == (40 << 30) // (4096 * 15552) == 674


def test_cli_writes_json_without_gpu(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        return  # the GPU run is the bench itself, not a unit test
    out = tmp_path / "mla.json"
    result = CliRunner().invoke(mla, ["--json", str(out), "--context", "1024"])
    assert result.exit_code == 0, result.output
    info = json.loads(out.read_text())
    assert info["kernel"] == [] and info["kernel_skipped"]
    assert info["capacity"][1]["model"] == "DeepSeek-V3"
    assert info["command"].startswith("pagedcore bench mla")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the breakdown's empty launch: 0 / 0
def test_quick_variant_bench_in_interpreter(tmp_path: Path) -> None:
    """`--quick --variants a,b --check` times both variants on a tiny case, checks them against
    the reference and writes rows, conformance results and a summary."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        return
    os.environ.setdefault("TRITON_INTERPRET", "1")
    pytest.importorskip("pagedcore_triton.mla")
    out = tmp_path / "mla.json"
    result = CliRunner().invoke(
        mla, ["--quick", "--variants", "n32s2,n32s5c4", "--breakdown", "n32s5c4pm64",
              "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    info = json.loads(out.read_text())
    rows = info["kernel"]
    assert [r["variant"] for r in rows] == ["n32s2", "n32s5c4"]
    assert all(r["rel_err"] < 1e-4 and r["ms"] > 0 for r in rows)
    assert sum(bool(r.get("best_for_shape")) for r in rows) == 1
    assert [json.loads(line)["variant"] for line in
            (tmp_path / "mla.json.rows.jsonl").read_text().splitlines()] == ["n32s2", "n32s5c4"]
    assert info["summary"]["best_variant"] is None  # no copy bandwidth on CPU
    assert "--variants n32s2,n32s5c4" in info["command"]
    # The breakdown: decode alone and the whole forward per shape (no merge: unsplit case).
    (bd,) = info["breakdown"]
    assert (bd["variant"], bd["batch"], bd["num_splits"]) == ("n32s5c4pm64", 2, 1)
    assert bd["decode_ms"] > 0 and bd["forward_ms"] > 0 and bd["empty_decode_ms"] > 0
    assert "merge_ms" not in bd
    assert "--breakdown n32s5c4pm64" in info["command"]


def test_unknown_variant_is_a_usage_error() -> None:
    if torch.cuda.is_available():
        return
    os.environ.setdefault("TRITON_INTERPRET", "1")
    pytest.importorskip("pagedcore_triton.mla")
    result = CliRunner().invoke(mla, ["--quick", "--variants", "nope", "--no-time"])
    assert result.exit_code == 2
    assert "unknown MLA kernel variant 'nope'" in result.output
    assert "n32s5" in result.output


def test_summary_picks_the_variant_with_the_best_mean() -> None:
    from pagedcore.bench.mla_kernel import summarize

    def row(variant: str, batch: int, pct: float, rel: float = 1e-3) -> dict[str, object]:
        return {"variant": variant, "batch": batch, "context": 1024, "pct_copy": pct,
                "rel_err": rel}

    rows = [row("a", 1, 90.0), row("a", 2, 40.0), row("b", 1, 70.0), row("b", 2, 69.0),
            row("b", 2, 60.0), row("c", 1, 99.0, rel=0.5), row("c", 2, 99.0, rel=0.5)]
    s = summarize(rows)
    assert s["variant_worst_shape_pct"] == {"a": 40.0, "b": 69.0}  # c is wrong: ignored
    assert s["best_variant"] == "b"
    assert s["best_pct_of_copy_per_shape"] == {"1x1024": 90.0, "2x1024": 69.0}
    assert s["met"] is False


def test_probe_summary_of_synthetic_timelines() -> None:
    """`summarize_probe` on four hand-made programs (SM 7 holds two): waits, spreads, loop
    and epilogue times, per-tile loop time, SM clock and how busy the grid is over its span."""
    from pagedcore.bench.mla_probe import summarize_probe

    # smid, t_start, t_go, t_loop, t_end (ns), tiles, cycles
    rows = [[7, 0, 1000, 9000, 10000, 16, 20000],
            [7, 0, 1000, 11000, 12000, 16, 24000],
            [3, 500, 2000, 8000, 9000, 16, 17000],
            [5, 0, 1000, 20000, 21000, 16, 42000]]
    s = summarize_probe(rows, kv_bytes=2_000_000)
    assert s["programs"] == 4 and s["sms"] == 3
    assert s["programs_per_sm"] == {"1": 2, "2": 1}
    assert s["span_us"] == 20.0  # first go at 1000 ns, last end at 21000 ns
    assert s["wait_us"]["max"] == 1.5 and s["wait_us"]["min"] == 1.0
    assert s["end_us"] == {"min": 8.0, "p10": 8.0, "med": 10.0, "p90": 20.0, "max": 20.0}
    assert s["loop_us"]["max"] == 19.0 and s["epilogue_us"]["med"] == 1.0
    assert s["loop_us_per_tile"]["min"] == 0.375
    assert s["duration_shared_sm_us"]["max"] == 11.0
    assert s["duration_alone_on_sm_us"] == {"min": 7.0, "p10": 7.0, "med": 13.5, "p90": 20.0,
                                            "max": 20.0}
    assert s["sm_clock_GHz"]["med"] == 2.0
    assert s["busy_fraction"] == round((9 + 11 + 7 + 20) / (4 * 20), 3)
    assert s["kv_GBps_over_span"] == 100.0


def test_mla_plot_draws_the_committed_h200_report(tmp_path: Path) -> None:
    """`pagedcore.bench.mla_plot` draws the committed H200 report (three panels) and a report
    without timing (capacity only); a wrong argument count is refused with its usage."""
    pytest.importorskip("matplotlib")
    from pagedcore.bench.mla_plot import main, plot_mla

    report_path = Path(__file__).parents[2] / "docs" / "benchmarks" / "mla_h200.json"
    out = tmp_path / "mla.png"
    main([str(report_path), str(out)])
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    report = json.loads(report_path.read_text())
    bare = {"capacity": report["capacity"], "summary": None, "breakdown": []}
    plot_mla(bare, str(tmp_path / "bare.png"))
    assert (tmp_path / "bare.png").stat().st_size > 5_000
    with pytest.raises(SystemExit, match="usage"):
        main([str(report_path)])


def test_backends_side_by_side_quick(tmp_path: Path) -> None:
    """`--backend A --backend B --quick`: one row per backend and shape with the time, the
    bandwidth and the error against the reference; the command records the backends."""
    if torch.cuda.is_available():
        return
    out = tmp_path / "mla.json"
    result = CliRunner().invoke(mla, ["--quick", "--backend", "reference_mla", "--backend",
                                      "reference_mla", "--json", str(out)])
    assert result.exit_code == 0, result.output
    info = json.loads(out.read_text())
    rows = info["backends"]
    assert [(r["backend"], r["batch"], r["context"]) for r in rows] == [
        ("reference_mla", 2, 64)] * 2
    assert all(r["rel_err"] == 0.0 and r["ms"] > 0 and r["kv_GBps"] > 0 for r in rows)
    assert info["kernel"] == [] and "--backend reference_mla" in info["command"]


@pytest.mark.parametrize(("name", "words"), [
    ("reference", "does not declare MLA"),
    ("nope", "unknown attention backend 'nope'"),
])
def test_backend_that_cannot_run_is_a_usage_error(name: str, words: str) -> None:
    result = CliRunner().invoke(mla, ["--quick", "--backend", name])
    assert result.exit_code == 2
    assert words in result.output and "triton_mla" in result.output
