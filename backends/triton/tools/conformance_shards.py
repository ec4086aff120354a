"""One shard of a backend's full conformance suite: ``cases[index::shards]`` in this process.

    python backends/triton/tools/conformance_shards.py OUT SHARDS INDEX [BACKEND] [--device D]

Started ``SHARDS`` times in parallel (Triton's on-disk cache is shared), the shards together
run every case of ``pagedcore conformance BACKEND`` (graph-plan and MLA cases in shard 0)
with one torch import and CUDA context per shard instead of one per case. Writes
``OUT/conformance_<index>.json`` as each case ends; `merge` (``... OUT merge [BACKEND]``)
sums the shards into ``OUT/conformance_<backend>_summary.json``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


def _row(r: Any) -> dict[str, Any]:
    return {"case": r.name, "passed": r.passed, "max_rel_error": r.max_rel_error,
            "tolerance": r.tolerance, "message": r.message, "skipped": r.skipped,
            "seconds": r.seconds}


def run_shard(out: Path, shards: int, index: int, backend: str, device: str) -> None:
    import torch

    from pagedcore.conformance.graphs import run_graph_case
    from pagedcore.conformance.harness import run_case
    from pagedcore.conformance.runner import (
        list_cases,
        list_graph_cases,
        mla_results,
        resolve_backend,
    )

    cls = resolve_backend(backend)
    rows: list[dict[str, Any]] = []
    path = out / f"conformance_{index}.json"
    info = {"backend": cls.name, "device": torch.cuda.get_device_name() if device == "cuda"
            else device, "shard": [index, shards], "rows": rows}
    cases = list_cases(cls, quick=False, device=device)[index::shards]
    for case in cases:
        rows.append(_row(run_case(cls, case, device=device)))
        path.write_text(json.dumps(info, indent=1))
    if index == 0:
        for graph_case in list_graph_cases(cls, quick=False, device=device):
            rows.append(_row(run_graph_case(cls, graph_case, device=device)))
            path.write_text(json.dumps(info, indent=1))
        for result in mla_results(cls, quick=False, device=device):
            rows.append(_row(result))
    path.write_text(json.dumps(info, indent=1))


def merge(out: Path, backend: str, device: str) -> None:
    from pagedcore.conformance.runner import list_cases, list_graph_cases, resolve_backend

    cls = resolve_backend(backend)
    listed = [c.name for c in [*list_cases(cls, device=device),
                               *list_graph_cases(cls, device=device)]]
    rows = []
    for f in sorted(out.glob("conformance_[0-9]*.json")):
        rows += json.loads(f.read_text())["rows"]
    ran = [r for r in rows if r["skipped"] is None]
    failed = [r["case"] for r in ran if not r["passed"]]
    errs = [r["max_rel_error"] for r in ran if r["max_rel_error"] is not None]
    seen = {r["case"] for r in rows}
    summary = {"backend": backend, "listed": len(listed),
               "not_run": [n for n in listed if n not in seen], "cases": len(rows),
               "ran": len(ran),
               "passed": len(ran) - len(failed), "failed": failed,
               "skipped": [r["case"] for r in rows if r["skipped"] is not None],
               "max_rel_error": max(errs, default=None), "rows": rows}
    (out / f"conformance_{backend}_summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}))


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    device = "cuda"
    if "--device" in sys.argv:
        device = sys.argv[sys.argv.index("--device") + 1]
        args.remove(device)
    out = Path(args[0])
    out.mkdir(parents=True, exist_ok=True)
    if args[1] == "merge":
        merge(out, args[2] if len(args) > 2 else "triton", device)
        return
    t0 = time.time()
    run_shard(out, int(args[1]), int(args[2]), args[3] if len(args) > 3 else "triton", device)
    print(f"shard {args[2]}/{args[1]} done in {time.time() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    main()
