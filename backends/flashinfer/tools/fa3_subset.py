"""Run the flashinfer conformance cases that FA3 prefill serves with the prebuilt modules
(float16, head size 128, no window / soft-cap) on the default kernels, and write the report.

    python backends/flashinfer/tools/fa3_subset.py OUT.json
"""

from __future__ import annotations

import sys

from pagedcore.conformance.harness import run_case
from pagedcore.conformance.report import ConformanceReport
from pagedcore.conformance.runner import list_cases, resolve_backend


def main(path: str) -> int:
    cls = resolve_backend("flashinfer")
    report = ConformanceReport(backend=cls.name, device="cuda", quick=False)
    for case in list_cases(cls, quick=False, device="cuda"):
        plain = case.sliding_window is None and case.logits_soft_cap is None
        if plain and case.dtype == "float16" and case.head_size == 128:
            result = run_case(cls, case, device="cuda")
            print(result, flush=True)
            report.results.append(result)
    print(report.summary())
    with open(path, "w") as fh:
        fh.write(report.to_json() + "\n")
    return 0 if all(r.passed for r in report.results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
