"""`gpu/cascade_mixed.py` (the mixed-cascade-graph measurement) runs end to end on the CPU
(`--smoke`: tiny model, no graphs), so the GPU round does not find it broken: every mode
times its join and prefill steps, the prefix cache is reset between modes, and with the
same prompts every mode generates the same tokens."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cascade_mixed_script_smoke(tmp_path: Path) -> None:
    out = tmp_path / "cm.json"
    subprocess.run(
        [sys.executable, str(ROOT / "gpu" / "cascade_mixed.py"), "--smoke", "--json", str(out),
         "--prefix", "64", "--own", "8", "--decoding", "6", "--joining", "2", "--reps", "1"],
        check=True, capture_output=True, text=True, timeout=300,
    )
    report = json.loads(out.read_text())
    assert set(report["modes"]) == {"off", "auto", "auto_no_mixed_graphs"}
    for row in report["modes"].values():
        assert len(row["join_step_ms"]) == len(row["prefill_step_ms"]) == 1
        assert 0 < row["join_forward_ms_median"] <= row["join_step_ms_median"]
        assert row["step_paths"] == {"eager (graphs off)": sum(row["step_paths"].values())}
    assert report["same_tokens_as_off"] == {"off": True, "auto": True,
                                            "auto_no_mixed_graphs": True}
    assert report["first_differences"] == {"off": [], "auto": [], "auto_no_mixed_graphs": []}


def test_first_differences_reports_how_close_a_call_it_was() -> None:
    """A flipped greedy token is reported once per request, at its first position, with the
    ``off`` run's top-2 logprob gap there and both runs' logprobs of the ``off`` token."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("cascade_mixed",
                                                  ROOT / "gpu" / "cascade_mixed.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    off = [("j1-0", [5, 6], [{5: -0.1, 7: -0.3}, {6: -0.5}]),
           ("j1-1", [3, 4], [{3: -0.2, 9: -1.0}, {4: -0.1, 2: -0.2}])]
    other = [("j1-0", [5, 6], [{5: -0.1, 7: -0.3}, {6: -0.5}]),
             ("j1-1", [3, 2], [{3: -0.2, 9: -1.0}, {2: -0.1, 4: -0.12}])]
    rows = module.first_differences(off, other)
    assert len(rows) == 1
    row = rows[0]
    assert (row["request"], row["position"], row["off_token"], row["token"]) == ("j1-1", 1, 4, 2)
    assert abs(row["off_top2_gap"] - 0.1) < 1e-9
    assert (row["off_token_logprob"], row["its_logprob_here"]) == (-0.1, -0.12)
