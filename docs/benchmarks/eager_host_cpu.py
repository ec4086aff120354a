"""Host work of an eager decode step on the CPU (issue 22): the numbers of eager_host_cpu.md.

Builds the Qwen2-0.5B shape (seeded random weights, fp32) with LAYERS decoder layers, forces
the fused modules on (the engine swaps them in on CUDA only: this is the GPU's eager path) and
runs the triton backend in Triton's interpreter. Kernel launches are counted and skipped
(STUB=1), so what is left is host work: the aten ops each step dispatches
(TorchDispatchMode) and the Python calls outside triton (cProfile).

    TRITON_INTERPRET=1 LAYERS=4 B=8 python docs/benchmarks/eager_host_cpu.py
"""

from __future__ import annotations

import collections
import cProfile
import os
import pstats
import random
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import triton.runtime.interpreter as interpreter
from torch.utils._python_dispatch import TorchDispatchMode

import pagedcore.engine.models.fused_ops as fused_ops
from pagedcore import SamplingParams
from pagedcore.bench.report import bench_model_config
from pagedcore.engine.llm import LLM

LAUNCHES: collections.Counter[str] = collections.Counter()
STUB = [False]
_real_run = interpreter.InterpretedFunction.run


def _run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
    if STUB[0] and not warmup:
        LAUNCHES[getattr(self.fn, "__name__", "?")] += 1
        return None
    return _real_run(self, *args, grid=grid, warmup=warmup, **kwargs)


class CountOps(TorchDispatchMode):
    """Counts the aten ops dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    """Build, warm up, count."""
    interpreter.InterpretedFunction.run = _run  # type: ignore[method-assign]
    if os.environ.get("FUSED", "1") == "1":
        fused_ops.fused_kernels_disabled_reason = lambda device: None  # type: ignore[assignment]
    layers = int(os.environ.get("LAYERS", "4"))
    batch = int(os.environ.get("B", "8"))
    cfg = bench_model_config("qwen2-0.5b")
    cfg.num_hidden_layers = layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:layers]
    cfg.vocab_size = 1024
    llm = LLM(cfg, device="cpu", dtype=torch.float32,
              backend=os.environ.get("BACKEND", "triton"), max_model_len=256,
              max_num_seqs=batch, kv_cache_memory_bytes=64 << 20)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        llm.add_request(str(i), [rng.randrange(1000) for _ in range(32)], params)
    for _ in range(4):  # prefill, then decodes
        llm.step()
    steps = 3
    STUB[0] = os.environ.get("STUB", "1") == "1"
    counter = CountOps()
    with counter:
        for _ in range(steps):
            llm.step()
    total = sum(counter.ops.values()) / steps
    print(f"aten ops per step: {total:.0f}  per layer ~{total / layers:.1f}")
    for name, n in counter.ops.most_common(25):
        print(f"  {n / steps:7.1f} {name}")
    LAUNCHES.clear()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        llm.step()
    prof.disable()
    stats: Any = pstats.Stats(prof)
    calls = sum(nc for (f, _l, _fn), (_cc, nc, *_rest) in stats.stats.items()
                if "/triton/" not in f)
    print(f"triton launches per step: {sum(LAUNCHES.values()) / steps:.0f} "
          f"{ {k: v / steps for k, v in LAUNCHES.items()} }")
    print(f"python calls per step (outside triton): {calls / steps:.0f}")


if __name__ == "__main__":
    main()
