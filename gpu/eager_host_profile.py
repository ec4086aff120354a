"""Where an eager decode step's host time goes on the GPU (issue 22): run by gpu/eager.sh.

Builds the bench's Qwen2-0.5B shape (seeded random weights) with CUDA graphs off, fills
`--batch` requests of `--context` tokens, then for `--steps` decode steps: the wall time per
step; torch.profiler's CPU-side ops (self CPU time and calls per step, the top 30); the triton
launches per step with their host time; and every host sync (``torch.cuda.set_sync_debug_mode``
warnings, which name the line). Writes ``eager_host.json`` and prints a summary.

    python3 gpu/eager_host_profile.py --out /tmp/out [--batch 256 --context 512 --steps 6]
"""

from __future__ import annotations

import argparse
import collections
import json
import time
import traceback
import warnings
from pathlib import Path
from typing import Any


def main() -> None:
    """Parse the arguments, profile, write the JSON."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from pagedcore.bench.report import engine_bench_model
    from pagedcore.bench.step import _fill
    from pagedcore.engine.llm import LLM

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev, dtype, config = engine_bench_model(False, None, "qwen2-0.5b")
    llm = LLM(config, device=dev, dtype=dtype, enforce_eager=True,
              max_model_len=args.context + 512, max_num_seqs=args.batch,
              max_num_batched_tokens=max(2048, args.batch))
    llm.set_async_scheduling(False)
    _fill(llm, args.batch, args.context, 400, 1000, 0)
    for _ in range(3):
        llm.step()
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        llm.step()
    sync()
    wall_ms = (time.perf_counter() - t0) / args.steps * 1e3
    phases_before = dict(llm.phase_time)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            llm.step()
        sync()
    phases = {k: (v - phases_before.get(k, 0.0)) / args.steps * 1e3
              for k, v in llm.phase_time.items()}
    rows = []
    for ev in prof.key_averages():
        rows.append({"name": ev.key[:100], "calls_per_step": ev.count / args.steps,
                     "self_cpu_us_per_step": ev.self_cpu_time_total / args.steps})
    rows.sort(key=lambda r: -r["self_cpu_us_per_step"])
    # Host syncs: each one the sync-debug mode reports, with the line that caused it.
    syncs: collections.Counter[str] = collections.Counter()
    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            llm.step()
    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        syncs[f"{w.filename}:{w.lineno}: {str(w.message)[:80]}"] += 1
    report: dict[str, Any] = {"batch": args.batch, "context": args.context,
                              "eager_step_ms": wall_ms, "host_phases_ms": phases,
                              "cpu_ops": rows[:60], "syncs_in_2_steps": dict(syncs)}
    (out / "eager_host.json").write_text(json.dumps(report, indent=1))
    print(f"eager step {wall_ms:.2f} ms at batch {args.batch}; phases {phases}")
    for r in rows[:30]:
        print(f"  {r['self_cpu_us_per_step']:9.1f} us {r['calls_per_step']:7.1f}x  {r['name']}")
    print("syncs in 2 steps:", dict(syncs) or "none")


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        raise
