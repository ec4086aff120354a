"""fp8 KV cache and attention sinks on every Triton decode plan (uniform split-KV, balanced).

The quick conformance run (test_conformance.py) covers the fp8 and sink cases on the default
plans; these run the `long` batch with sinks and an e4m3 cache (split-KV decodes, a chunk
continuing a long prefix) on both
decode plans, where the sink must enter exactly one segment of each row and the fp8 scales
must survive the merge of the segments.
"""

from __future__ import annotations

import pytest
import torch
from pagedcore_triton.plan import DECODE_PLAN_ENV

from pagedcore.conformance import run_suite


@pytest.mark.parametrize("plan", ["uniform", "balanced:16"])
def test_long_batch_fp8_and_sinks_on_each_decode_plan(
    plan: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(DECODE_PLAN_ENV, plan)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    case = "long/float32/hs128/bs16/h8kv2/sinks/fp8_e4m3"
    if device == "cuda":
        case = case.replace("float32", "float16")
    report = run_suite("triton", device=device, case_filter=case)
    assert [r.name.split("/")[0] for r in report.results] == ["long"], report.summary()
    assert report.passed, report.summary()
