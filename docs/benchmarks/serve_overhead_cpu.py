"""Where the server's engine time goes, on CPU (issue 23): `LLM.generate` against the serve
engine loop (`CoreLoop`, pickling each step's items as the engine process does), per step.

The model is a tiny random Llama whose attention is replaced by a copy, so a step costs about
what an H200 step of Qwen2-0.5B costs the host (a few ms) and the per-request work of serving
shows. Reported: CPU ms per step (the minimum over `--repeats` runs of each mode: the machine
is shared), the pickled bytes per step.

    python docs/benchmarks/serve_overhead_cpu.py --json docs/benchmarks/serve_overhead_cpu.json
"""

from __future__ import annotations

import argparse
import json
import pickle
import platform
import subprocess
import time
from typing import Any


def _null_attention() -> None:
    """toy_sdpa's attention becomes a copy of the query (the step's host work stays)."""
    import torch
    from pagedcore_toy_sdpa import impl

    def forward(self: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: Any, *, output: Any = None) -> torch.Tensor:
        out = torch.empty_like(query) if output is None else output
        return out.copy_(query)

    for name in dir(impl):
        obj = getattr(impl, name)
        if isinstance(obj, type) and obj.__module__ == impl.__name__ and "Impl" in name:
            obj.forward = forward  # type: ignore[attr-defined]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--input-len", default="16:64")
    p.add_argument("--output-len", default="64:128")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    import torch

    torch.set_num_threads(1)
    _null_attention()
    from pagedcore import LLM, SamplingParams
    from pagedcore.bench.serve import make_workload
    from pagedcore.serve.core_loop import CoreLoop

    rng = lambda t: tuple(int(x) for x in t.split(":"))  # noqa: E731
    llm = LLM("random:llama", device="cpu", backend="toy_sdpa", max_model_len=512,
              max_num_seqs=256, max_num_batched_tokens=2048, kv_cache_memory_bytes=64 * 2**20)
    work = make_workload(a.num_requests, input_len=rng(a.input_len),
                         output_len=rng(a.output_len), seed=0, token_range=(3, 120))
    params = [SamplingParams(max_tokens=w.output_len, temperature=0, ignore_eos=True)
              for w in work]
    llm.generate([w.prompt for w in work[:4]], SamplingParams(max_tokens=4))

    def run(mode: str) -> dict[str, float]:
        s0, t0, c0 = llm.num_steps, time.perf_counter(), time.process_time()
        sent = [0, 0]  # bytes, tokens
        if mode == "generate":
            outs = llm.generate([w.prompt for w in work], params)
            sent[1] = sum(len(o.outputs[0].token_ids) for o in outs)
        else:
            cmds: list[Any] = [("add", f"r{i}", w.prompt, sp)
                               for i, (w, sp) in enumerate(zip(work, params, strict=True))]

            def emit(items: list[Any], stats: Any) -> None:
                blob = pickle.dumps(("step", items, stats), protocol=pickle.HIGHEST_PROTOCOL)
                sent[0] += len(blob)
                sent[1] += sum(len(item[2]) for _, item in items)
                if not llm.has_unfinished_requests() and not cmds:
                    cmds.append(("stop",))

            interval = int(mode.split("=")[1])
            CoreLoop(llm, emit, stream_interval=interval).run(
                lambda block: cmds.pop(0) if cmds else None)
        steps = llm.num_steps - s0
        return {"cpu_ms_per_step": 1000 * (time.process_time() - c0) / steps,
                "wall_ms_per_step": 1000 * (time.perf_counter() - t0) / steps,
                "steps": steps, "output_tokens": sent[1], "pickled_bytes_per_step": sent[0] / steps}

    modes = ["generate", "core_loop stream_interval=1", "core_loop stream_interval=4"]
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for _ in range(a.repeats):
        for m in modes:
            runs[m].append(run(m))
    best = {m: min(r, key=lambda x: x["cpu_ms_per_step"]) for m, r in runs.items()}
    base = best["generate"]["cpu_ms_per_step"]
    for m, r in best.items():
        r["over_generate"] = r["cpu_ms_per_step"] / base
        print(f"{m:30s} {r['cpu_ms_per_step']:6.2f} CPU ms/step ({r['over_generate']:.2f}x), "
              f"{r['steps']} steps, {r['output_tokens']} tokens")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    report = {"command": "python docs/benchmarks/serve_overhead_cpu.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if v is not None),
              "commit": commit, "python": platform.python_version(),
              "torch": torch.__version__, "workload": vars(a), "best": best, "runs": runs}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
