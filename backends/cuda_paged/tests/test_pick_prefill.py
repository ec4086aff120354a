"""The GPU job's default-prefill pick (bench/pick_prefill.py) on synthetic result files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pagedcore_cuda_paged.plan import DEFAULT_PREFILL_KERNEL
from pick_prefill import main

DEFAULT = DEFAULT_PREFILL_KERNEL.value
SHAPES = ("4x2048", "4x8192", "4x2048+6144cached")


def _files(tmp_path: Path, ms: dict[str, tuple[float, float, float]],
           failed: frozenset[str] = frozenset(),
           unchecked: frozenset[str] = frozenset()) -> list[str]:
    cases = [dict(case=f"dtype=bfloat16 prefill=PrefillKernel.{k.upper()} reqs=LONG",
                  ok=k not in failed, rel_err=0.0) for k in ms if k not in unchecked
             for _ in range(2)]
    rows = [dict(case="prefill", impl=f"cuda_paged/{k}", shape=s, ms=t)
            for k, times in ms.items() for s, t in zip(SHAPES, times, strict=True)]
    (tmp_path / "check.json").write_text(json.dumps(dict(cases=cases)))
    (tmp_path / "bench.json").write_text(json.dumps(dict(prefill=rows)))
    return [str(tmp_path / "check.json"), str(tmp_path / "bench.json")]


def _last(capsys: pytest.CaptureFixture[str]) -> str:
    return capsys.readouterr().out.strip().splitlines()[-1]


def test_picks_the_fastest_qualifying_kernel(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    # candidate names other than the shipped default, whichever kernel that is
    a, b, c, d, e, f = [k for k in ("mma_128_fast", "mma_128_fast_hm", "mma_128_fast_wm",
                                    "mma_128_fast_wm_1b", "mma_128_fast_wmp", "mma_128_fast_hm_wm",
                                    "mma_128_fast_wmp_1b") if k != DEFAULT][:6]
    ms = {DEFAULT: (1.0, 10.0, 4.0),
          a: (0.97, 9.8, 4.0),       # qualifies (ratio 0.98)
          b: (0.95, 9.6, 4.02),      # best worst-shape ratio (0.96)
          c: (0.90, 9.0, 4.0),       # fastest, but a check failed
          d: (0.90, 10.1, 3.9),      # slower at 4x8192
          e: (0.90, 9.0, 4.2),       # 5% slower on the cached chunk
          f: (0.80, 8.0, 3.0)}       # never checked
    assert main(_files(tmp_path, ms, failed=frozenset({c}), unchecked=frozenset({f}))) == 0
    assert _last(capsys) == f"PICK {b}"


def test_keeps_the_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ms = {DEFAULT: (1.0, 10.0, 4.0), "mma_128_fast_wm": (1.01, 9.0, 3.0)}
    assert main(_files(tmp_path, ms)) == 0
    assert _last(capsys) == f"KEEP {DEFAULT}"
    # no correctness file (the check timed out): nothing may replace the default
    assert main([str(tmp_path / "missing.json"), str(tmp_path / "bench.json")]) == 0
    assert _last(capsys) == f"KEEP {DEFAULT}"
