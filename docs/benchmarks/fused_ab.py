"""A/B of the fused RMSNorm / SiLU-mul kernels in one process: decode step time with
transformers' modules, then the same engine after `swap_fused_modules` (graphs recaptured).

    python3 docs/benchmarks/fused_ab.py MODEL OUT_JSON [BATCHES]   (BATCHES default "64,1")

Per batch: 256-token prompts, 20 steps to prefill and settle, 15 timed steps (synced),
3 steps under the profiler (GPU kernel time and kernel count per step).
Also the greedy tokens of 4 prompts with and without the swap.
CPU dry run: TRITON_INTERPRET=1, MODEL random:llama, BATCHES 1,2.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

os.environ["PAGEDCORE_FUSED_KERNELS"] = "0"  # build unswapped; swap by hand below

from pagedcore.engine.llm import LLM
from pagedcore.engine.models.fused_ops import swap_fused_modules
from pagedcore.engine.sampling.sampling_params import SamplingParams


def main() -> None:
    model = sys.argv[1]
    out_path = sys.argv[2]
    batches = [int(b) for b in (sys.argv[3] if len(sys.argv) > 3 else "64,1").split(",")]
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    llm = LLM(model, backend="triton" if cuda else "reference",
              kv_cache_memory_bytes=(16 << 30) if cuda else (64 << 20),
              cudagraph_capture_sizes=sorted(set(batches)) if cuda else None)
    print(f"built in {time.perf_counter() - t0:.1f}s; graphs", llm.cudagraph_status(), flush=True)
    runner = llm.runner
    vocab = min(1000, int(llm.model.config.vocab_size))
    result: dict[str, object] = {"model": model, "command": " ".join(sys.argv), "runs": {}}

    def save() -> None:
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)

    def greedy() -> list[list[int]]:
        gen = torch.Generator().manual_seed(7)
        prompts = [torch.randint(10, vocab, (n,), generator=gen).tolist() for n in (5, 33, 90, 200)]
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0,
                                                    ignore_eos=True))
        return [o.outputs[0].token_ids for o in outs]

    def measure(tag: str) -> None:
        runs: dict[str, object] = {}
        result["runs"][tag] = runs  # type: ignore[index]
        gen = torch.Generator().manual_seed(0)
        for batch in batches:
            params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
            for i in range(batch):
                prompt = torch.randint(10, vocab, (256,), generator=gen).tolist()
                llm.add_request(f"{tag}-b{batch}-{i}", prompt, params)
            for _ in range(20):
                llm.step()
            sync()
            walls = []
            for _ in range(15):
                t = time.perf_counter()
                llm.step()
                sync()
                walls.append((time.perf_counter() - t) * 1e3)
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=acts) as prof:
                for _ in range(3):
                    llm.step()
                sync()
            dev = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
            gpu_ms = sum(e.self_device_time_total for e in dev) / 3 / 1e3
            kernels = sum(e.count for e in dev) / 3
            wall = sorted(walls)[len(walls) // 2]
            runs[str(batch)] = {"wall_ms_median": wall, "wall_ms": walls,
                                "gpu_ms_per_step": gpu_ms, "kernels_per_step": kernels}
            print(f"[{tag}] batch {batch}: wall median {wall:.2f} ms, GPU {gpu_ms:.2f} ms, "
                  f"{kernels:.0f} kernels/step (+{time.perf_counter() - t0:.0f}s)", flush=True)
            while llm.has_unfinished_requests():
                llm.step()
            save()

    result["tokens_off"] = greedy()
    measure("off")
    result["swapped"] = swap_fused_modules(llm.model)
    print("swapped", result["swapped"], flush=True)
    t = time.perf_counter()
    runner.release_graphs()
    if cuda:
        runner.enable_cudagraphs(sizes=sorted(set(batches)))
    print(f"recaptured in {time.perf_counter() - t:.1f}s", llm.cudagraph_status(), flush=True)
    result["tokens_on"] = greedy()
    same = [a == b for a, b in zip(result["tokens_off"], result["tokens_on"], strict=True)]  # type: ignore[call-overload]
    first = [a[0] == b[0] for a, b in zip(result["tokens_off"], result["tokens_on"], strict=True)]  # type: ignore[call-overload]
    result["greedy_same_all8"], result["greedy_same_first"] = same, first
    print("greedy tokens equal (all 8 / first):", same, first, flush=True)
    save()
    measure("on")
    print(f"done in {time.perf_counter() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    main()
