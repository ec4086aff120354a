"""``tools/cascade_sass_stats.py``: the programs-per-SM arithmetic, and one prefix shape with a
register cap and one suffix shape compiled for sm_90 (no GPU needed) within their limits."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from _sm90 import compile_script_for_sm90

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def test_programs_per_sm_limits() -> None:
    sys.path.insert(0, str(TOOLS))
    from cascade_sass_stats import programs_per_sm

    # The shipped prefix shape offline: 255 registers x 4 warps -> 2 programs per SM.
    assert programs_per_sm(255, 4, 82944)["programs_per_sm"] == 2
    # 94 registers round up to 96 per thread: 5 programs of 4 warps.
    assert programs_per_sm(94, 4, 21760) == {"by_registers": 5, "by_shared_memory": 10,
                                              "programs_per_sm": 5}
    # Shared memory limits: 120 KB per program -> 1.
    assert programs_per_sm(32, 4, 120 * 1024)["programs_per_sm"] == 1


def test_cascade_shapes_compile_for_sm90(tmp_path: Path) -> None:
    script = (f"import sys; sys.path.insert(0, {str(TOOLS)!r}); import cascade_sass_stats as c; "
              "c.main(['--prefix', '64,32,8,3,2,r128', '--suffix', '32,4,4'])")
    rows = [json.loads(line) for line in compile_script_for_sm90(script, tmp_path).splitlines()
            if line.startswith("{")]
    assert [r.get("launch") for r in rows] == ["prefix", "suffix"], rows
    prefix, suffix = rows
    assert prefix["registers"] <= 128 and prefix["programs_per_sm"] >= 2, prefix
    assert suffix["registers"] <= 255 and suffix["programs_per_sm"] >= 1, suffix
