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
