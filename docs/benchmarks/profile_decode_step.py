"""Where a decode step's time goes: wall time per step against GPU kernel time (torch profiler).

    python docs/benchmarks/profile_decode_step.py [MODEL] [OUT_JSON]

MODEL defaults to ``random:llama3-8b`` (seeded random weights, bf16, CUDA graphs, triton); on a
machine without CUDA the reference backend runs with a small KV budget (a smoke run). For batch
1 and 64 (1 and 4 on CPU): 256-token prompts, 20 steps to prefill and settle, 10 timed steps
(synchronised), then 5 steps under the profiler; prints the kernels by GPU time and the host
calls by CPU time, and writes the per-step figures to OUT_JSON.
"""

from __future__ import annotations

import json
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from pagedcore.engine.llm import LLM
from pagedcore.engine.sampling.sampling_params import SamplingParams


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else "random:llama3-8b"
    out_path = sys.argv[2] if len(sys.argv) > 2 else "profile_decode_step.json"
    cuda = torch.cuda.is_available()
    llm = LLM(model, backend="triton" if cuda else "reference",
              kv_cache_memory_bytes=(16 << 30) if cuda else (64 << 20))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    status = {k: v for k, v in llm.cudagraph_status().items() if k != "sizes"}
    print("graphs", status, flush=True)
    vocab = min(1000, int(llm.model.config.vocab_size))
    gen = torch.Generator().manual_seed(0)
    figures: dict[int, dict[str, object]] = {}
    for batch in (1, 64) if cuda else (1, 4):
        params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            prompt = torch.randint(10, vocab, (256,), generator=gen).tolist()
            llm.add_request(f"b{batch}-{i}", prompt, params)
        for _ in range(20):  # prefill (16K tokens at batch 64) and settle
            llm.step()
        sync()
        walls = []
        for _ in range(10):
            t0 = time.perf_counter()
            llm.step()
            sync()
            walls.append(time.perf_counter() - t0)
        with profile(activities=activities) as prof:
            for _ in range(5):
                llm.step()
            sync()
        events = prof.key_averages()
        gpu_us = sum(e.self_device_time_total for e in events
                     if e.device_type.name == "CUDA") / 5
        wall_ms = sorted(walls)[len(walls) // 2] * 1e3
        print(f"\n== batch {batch}: wall per step (synced) median {wall_ms:.2f} ms; "
              f"GPU kernel time per step {gpu_us / 1e3:.2f} ms", flush=True)
        by_gpu = "self_device_time_total" if cuda else "self_cpu_time_total"
        print(events.table(sort_by=by_gpu, row_limit=15, max_name_column_width=60))
        print(events.table(sort_by="self_cpu_time_total", row_limit=15,
                           max_name_column_width=60))
        figures[batch] = {"wall_ms": [w * 1e3 for w in walls], "gpu_ms_per_step": gpu_us / 1e3}
        while llm.has_unfinished_requests():
            llm.step()
    with open(out_path, "w") as f:
        json.dump({"model": model, "command": " ".join(sys.argv), "per_batch": figures}, f,
                  indent=1)


if __name__ == "__main__":
    main()
