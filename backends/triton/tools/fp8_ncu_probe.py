"""One fp8 and one bf16 decode launch of the shipped defaults, for Nsight Compute.

    ncu --clock-control none --kernel-name regex:paged_attention \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
        --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
        python3 backends/triton/tools/fp8_ncu_probe.py [BATCHxCONTEXT]

At 64x4096 by default (32 query / 8 KV heads, head size 128, block size 16, random block
order, unused slots NaN: `fp8_decode_sweep.build_cache`), per dtype: one launch over the
checked lengths (its output compared with the float32 reference and the error printed),
then one over the full contexts (the timed shape). ncu profiles every ``paged_attention``
launch: two per dtype, the same kernel. Issue 24 asks why the fp8 decode stays at
~0.19-0.21 ms on both the H100 and the H200 while bf16 follows the bandwidth: this is where
its stall reasons come from.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    import fp8_decode_sweep as sweep
    import torch

    batch, context = (int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "64x4096").split("x"))
    gen = torch.Generator().manual_seed(0)
    jobs = {"e4m3": ("e4m3", batch, context, 1, 128, 4, 5, 1, 0, "o"),
            "bf16": ("bf16", batch, context, 0, 64, 4, 3, 1, 0, "o")}
    for dt, job in jobs.items():
        cache = sweep.build_cache(dt, batch, context, gen)
        _, run = sweep._launch(job, cache["kv"], cache["query"], cache["lens_c"])
        got = run().float()
        err = float((got - cache["ref"]).norm() / cache["ref"].norm())
        print(f"{dt}: rel. error {err:.2e} against the float32 reference", flush=True)
        _, run_t = sweep._launch(job, cache["kv"], cache["query"], cache["lens_t"])
        run_t()
        torch.cuda.synchronize()
        del cache


if __name__ == "__main__":
    main()
