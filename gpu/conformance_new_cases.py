"""Session 28's new conformance cases on every GPU backend, one process, one JSON.

    python3 gpu/conformance_new_cases.py OUT.json [BACKEND ...]

Runs, per backend (default: triton cuda_paged flashinfer flex), the full suite's cases whose
names hold one of `NEW` (the cases a mutation pass showed missing: three steps on one impl,
builder and cache; late fp8 scales; saturating fp8 scales; prefill chunks past 128 rows;
contexts past 4,096 keys; more than 8 requests; 8 KV heads; 32- and 64-token blocks; the
output= buffer in every dtype; cascade with sinks or fp8), and writes each case's result.
"""

from __future__ import annotations

import json
import sys
import time

NEW = ("steps3", "late_scales", "saturating", "long_prefill/", "very_long/", "wide/",
       "h16kv8", "/bs32/", "/bs64/", "out_buffer")


def main() -> None:
    from pagedcore.conformance import harness
    from pagedcore.conformance.cases import build_cases
    from pagedcore.plugins.registry import get_registry

    out_path, names = sys.argv[1], sys.argv[2:] or ["triton", "cuda_paged", "flashinfer", "flex"]
    report: dict[str, object] = {"new_case_keys": NEW, "backends": {}}
    for name in names:
        try:
            backend = get_registry().get(name)
        except Exception as exc:  # not installed / failed to load here
            report["backends"][name] = {"skipped": f"{type(exc).__name__}: {exc}"}
            continue
        why = backend.is_available()
        if why is not None:
            report["backends"][name] = {"skipped": why}
            continue
        rows = []
        t0 = time.perf_counter()
        for case in build_cases(backend, device="cuda"):
            if not any(key in case.name for key in NEW):
                continue
            r = harness.run_case(backend, case, device="cuda")
            rows.append({"case": r.name, "passed": r.passed, "skipped": r.skipped,
                         "max_rel_error": r.max_rel_error, "message": r.message})
            print(f"{name:11s} {'PASS' if r.passed else 'SKIP' if r.skipped else 'FAIL'} "
                  f"{r.name} {r.message or ''}", flush=True)
        report["backends"][name] = {"seconds": time.perf_counter() - t0, "cases": rows,
                                    "failed": [x["case"] for x in rows
                                               if not x["passed"] and not x["skipped"]]}
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
