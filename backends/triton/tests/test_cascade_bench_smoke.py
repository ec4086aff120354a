"""``docs/benchmarks/run_cascade_h200.sh --smoke``: the script the H200 run uses, on tiny shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke mode is the CPU interpreter's")
def test_run_cascade_script_smoke(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(ROOT / "docs/benchmarks/run_cascade_h200.sh"), "--smoke"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    conf = json.loads((tmp_path / "cascade_conformance.json").read_text())
    assert conf["passed"], conf
    result = json.loads((tmp_path / "cascade_h200.json").read_text())
    assert result["interpreter"]
    target = result["target"]
    assert target["common_prefix_len"] == 32 and not target["nan"]
    assert target["rel_err_cascade_vs_plain"] < 1e-4, target
    assert result["unshared"]["common_prefix_len"] == 0
    assert not result["unshared"]["cascade_planned"]
    assert [r["num_reqs"] for r in result["sweep"]] == [2, 4]
    assert all(r["rel_err_cascade_vs_plain"] < 1e-4 for r in result["sweep"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke mode is the CPU interpreter's")
def test_cascade_probe_smoke(tmp_path: Path) -> None:
    """``backends/triton/tools/cascade_probe.py --smoke``: the step, its parts and the shape
    sweeps on tiny shapes, every cascade equal to the plain step."""
    out = tmp_path / "probe.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "backends/triton/tools/cascade_probe.py"), "--smoke",
         "--json", str(out)],
        cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True,
        text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["rel_err_cascade"] < 1e-5 and not result["nan"], result
    for part in ("prefix_only_ms", "suffix_with_merge_ms", "suffix_no_merge_ms",
                 "own_only_decode_ms"):
        assert result[part] > 0, part
    sweeps = result["prefix_variants"] + result["suffix_variants"]
    assert len(sweeps) == 3 and all("error" not in r for r in sweeps), sweeps
    assert all(r["rel_err"] < 1e-5 and r["cascade_ms"] > 0 for r in sweeps), sweeps
