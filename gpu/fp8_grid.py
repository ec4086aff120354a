"""cuda_paged fp8 decode on CUDA over a grid the quick conformance list does not reach: head
sizes, block sizes, GQA groups (1, 4, 7, 8: the keys-as-rows kernel at head sizes 64 / 128;
16: the grouped kernel), batches (one pass and partitioned:
decode and long), e4m3 / e5m2, fp16 / bf16 queries, windows and soft-cap; each a conformance
case (NaN-poisoned unused slots, the reference dequantizes what the kernel reads).

    python3 gpu/fp8_grid.py OUT.json     # on a CUDA machine with the extension built
"""
import itertools
import json
import sys

import attrs
from pagedcore_cuda_paged import CudaPagedBackend

from pagedcore.conformance.cases import build_cases
from pagedcore.conformance.harness import run_case

base = {c.batch: c for c in build_cases(CudaPagedBackend, device="cuda")
        if c.kv_cache_dtype == "fp8_e4m3" and c.batch in ("decode", "long", "mixed")}
rows, failed = [], 0
grid = itertools.product(("decode", "long", "mixed"), ("float16", "bfloat16"),
                         ("fp8_e4m3", "fp8_e5m2"), (64, 96, 128), (16, 32),
                         ((8, 2), (32, 2), (2, 2), (14, 2), (16, 2)))
for batch, dtype, kv, hs, bs, (hq, hkv) in grid:
    case = attrs.evolve(base[batch], dtype=dtype, kv_cache_dtype=kv, head_size=hs,
                        block_size=bs, num_heads=hq, num_kv_heads=hkv,
                        name=f"{batch}/{dtype}/hs{hs}/bs{bs}/h{hq}kv{hkv}/{kv}")
    r = run_case(CudaPagedBackend, case, device="cuda")
    failed += not r.passed
    rows.append({"name": case.name, "passed": r.passed, "max_rel_error": r.max_rel_error,
                 "tolerance": r.tolerance, "message": r.message})
for extra in ({"sliding_window": 37}, {"logits_soft_cap": 30.0}):
    for dtype in ("float16", "bfloat16"):
        case = attrs.evolve(base["decode"], dtype=dtype, name=f"decode/{dtype}/{extra}", **extra)
        r = run_case(CudaPagedBackend, case, device="cuda")
        failed += not r.passed
        rows.append({"name": case.name, "passed": r.passed, "max_rel_error": r.max_rel_error,
                     "tolerance": r.tolerance, "message": r.message})
json.dump({"cases": rows, "failed": failed}, open(sys.argv[1], "w"), indent=1)
worst = max((r["max_rel_error"] or 0) / (r["tolerance"] or 1) for r in rows)
print(f"{len(rows)} cases, {failed} failed; worst error / tolerance {worst:.3f}")
for r in rows:
    if not r["passed"]:
        print("FAILED", r["name"], r["message"])
