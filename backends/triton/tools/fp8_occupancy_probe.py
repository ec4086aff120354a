"""fp8 decode variants at one shape with their registers, spills and shared memory (one GPU).

    python backends/triton/tools/fp8_occupancy_probe.py [BATCHxCONTEXT]

Nsight Compute on the H200 (``docs/benchmarks/h200_s20/``) found the shipped fp8 decode at 255
registers per thread, so two programs per SM (12.5 % occupancy) against four for bf16, and
57 % of DRAM bandwidth against 87 %. This times a few variants that should need fewer
registers (a ``maxnreg`` cap, 64-token tiles, 8 warps, fewer stages), each first checked
against the float32 reference of `fp8_decode_sweep.build_cache`, and prints one JSON line per
variant with Triton's register / spill / shared-memory counts of the kernel it compiled.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: (dtype, KV_CVT, tile tokens, warps, stages, maxnreg, flags) at 1 segment
VARIANTS = [
    ("bf16", 0, 64, 4, 3, 0, "o"),
    ("e4m3", 1, 128, 4, 5, 0, "o"),
    ("e4m3", 1, 128, 4, 5, 168, "o"),
    ("e4m3", 1, 128, 4, 5, 128, "o"),
    ("e4m3", 1, 64, 4, 5, 0, "o"),
    ("e4m3", 1, 64, 4, 4, 128, "o"),
    ("e4m3", 1, 128, 8, 5, 0, "o"),
    ("e4m3", 1, 128, 4, 3, 0, "o"),
]


def kernel_facts(fn: Any) -> list[dict[str, Any]]:
    """Registers, spills and shared memory of every compiled variant of `fn` (Triton's
    in-memory cache; empty where this Triton keeps it elsewhere)."""
    facts = []
    for entry in getattr(fn, "device_caches", {}).values():
        cache = entry[0] if isinstance(entry, tuple) else entry
        for kernel in getattr(cache, "values", lambda: [])():
            facts.append({"regs": getattr(kernel, "n_regs", None),
                          "spills": getattr(kernel, "n_spills", None),
                          "shared": getattr(getattr(kernel, "metadata", None), "shared", None)})
    return facts


def main() -> None:
    import fp8_decode_sweep as sweep
    import torch
    from pagedcore_triton.kernels.attention import paged_attention_kernel

    from pagedcore.bench.kernel_primitives import time_ms

    batch, context = (int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "64x4096").split("x"))
    gen = torch.Generator().manual_seed(0)
    caches: dict[str, Any] = {}
    seen = 0
    for dt, cvt, tile, warps, stages, maxnreg, flags in VARIANTS:
        job = (dt, batch, context, cvt, tile, warps, stages, 1, maxnreg, flags)
        if dt not in caches:
            caches[dt] = sweep.build_cache(dt, batch, context, gen)
        c = caches[dt]
        _, run_c = sweep._launch(job, c["kv"], c["query"], c["lens_c"])
        got = run_c().float()
        err = float((got - c["ref"]).norm() / c["ref"].norm())
        _, run_t = sweep._launch(job, c["kv"], c["query"], c["lens_t"])
        ms = time_ms(run_t, torch.device("cuda"), budget_ms=5.0)
        facts = kernel_facts(paged_attention_kernel)
        new = facts[seen:]
        seen = len(facts)
        print(json.dumps({"variant": job, "us": round(ms * 1e3, 1), "rel_err": err,
                          "cache_GBps": round(c["bytes"] / ms / 1e6),
                          "kernels": new}), flush=True)


if __name__ == "__main__":
    main()
