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
