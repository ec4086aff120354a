"""Where an eager decode step's host time goes, function by function (issue 22): cProfile.

torch.profiler's CPU ops (`gpu/eager_host_profile.py`) account for ~9 of the ~18-30 ms an
eager Qwen2-0.5B decode step at batch 256 takes on the H200; the rest is Python that no aten op
covers (transformers' model code, our modules, Triton's launcher). This runs the same step
under `cProfile` and writes the functions by own time and by cumulative time, plus the host
cost per call of the primitives an eager layer dispatches (a torch add, a linear, our fused
norm and rotary launches), timed back to back without syncs.

    python3 gpu/eager_cprofile.py --out /tmp/out [--batch 256 --context 512 --steps 4]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
import traceback
from pathlib import Path
from typing import Any


def _host_us(fn: Any, calls: int = 400) -> float:
    """Host microseconds per call of `fn` (the device runs behind; synced at both ends)."""
    import torch

    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return host / calls * 1e6


def primitives() -> dict[str, float]:
    """Host µs per call of the ops an eager 0.5B layer at batch 256 dispatches."""
    import torch
    import torch.nn.functional as F

    from pagedcore.engine.models import fused_attention, fused_ops

    dev = torch.device("cuda")
    x = torch.randn(256, 896, device=dev, dtype=torch.bfloat16)
    w = torch.randn(896, 896, device=dev, dtype=torch.bfloat16)
    nw = torch.ones(896, device=dev, dtype=torch.bfloat16)
    qkv = torch.randn(256, 18, 64, device=dev, dtype=torch.bfloat16)
    cos = torch.randn(256, 64, device=dev, dtype=torch.bfloat16)
    sin = torch.randn(256, 64, device=dev, dtype=torch.bfloat16)
    out: dict[str, float] = {
        "torch_add": _host_us(lambda: x + x),
        "torch_empty": _host_us(lambda: torch.empty(256, 896, device=dev, dtype=x.dtype)),
        "F_linear": _host_us(lambda: F.linear(x, w)),
        "view_reshape": _host_us(lambda: x.view(256, 14, 64).reshape(256, 896)),
        "add_rms_norm": _host_us(lambda: fused_ops.add_rms_norm(x, x, nw, eps=1e-6)),
        "apply_rotary": _host_us(lambda: fused_attention.apply_rotary(
            qkv, cos, sin, first_heads=14, second_heads=2)),
    }
    return out


def main() -> None:
    """Parse the arguments, profile, write the files."""
    import torch

    from pagedcore.bench.report import engine_bench_model
    from pagedcore.bench.step import _fill
    from pagedcore.engine.llm import LLM

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--shape", default="qwen2-0.5b")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"batch": args.batch, "shape": args.shape}
    report["primitives_host_us"] = primitives()
    print("primitives (host us/call):", report["primitives_host_us"], flush=True)

    dev, dtype, config = engine_bench_model(False, None, args.shape)
    llm = LLM(config, device=dev, dtype=dtype, enforce_eager=True,
              max_model_len=args.context + 512, max_num_seqs=args.batch,
              max_num_batched_tokens=max(2048, args.batch))
    llm.set_async_scheduling(False)
    _fill(llm, args.batch, args.context, 400, 1000, 0)
    for _ in range(3):
        llm.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        llm.step()
    torch.cuda.synchronize()
    report["eager_step_ms"] = (time.perf_counter() - t0) / args.steps * 1e3
    print(f"eager step {report['eager_step_ms']:.2f} ms", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        llm.step()
    torch.cuda.synchronize()
    prof.disable()
    prof.dump_stats(str(out / "eager.prof"))
    for key, name in (("tottime", "by_tottime.txt"), ("cumulative", "by_cumtime.txt")):
        buf = io.StringIO()
        stats = pstats.Stats(prof, stream=buf)
        stats.sort_stats(key).print_stats(70)
        (out / name).write_text(buf.getvalue())
    (out / "eager_cprofile.json").write_text(json.dumps(report, indent=1))
    print((out / "by_tottime.txt").read_text()[:6000])


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        raise
