"""Host time of `LLM.add_request` for a 4,160-id prompt (a warm 4K prefix hit's request:
issue #22 counts it inside the first token), on the CPU with the tiny model (the model does
not enter: the request is aborted before any step). Median and 10th percentile of 300.

    python docs/benchmarks/add_request_cpu.py [--json OUT.json] [--label NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time


def main() -> None:
    import torch

    from pagedcore import SamplingParams
    from pagedcore.bench.report import engine_bench_model
    from pagedcore.engine.llm import LLM

    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    dev, dtype, config = engine_bench_model(True, "cpu", "qwen2-0.5b")
    config.max_position_embeddings = 4400
    llm = LLM(config, device=dev, dtype=dtype, max_model_len=4400, max_num_seqs=4,
              kv_cache_memory_bytes=64 << 20)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (4160,), generator=g).tolist() for _ in range(20)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times = []
    for k in range(300):
        t0 = time.perf_counter()
        llm.add_request(f"r{k}", prompts[k % 20], params)
        times.append(time.perf_counter() - t0)
        llm.abort(f"r{k}")
    row = {"label": args.label, "median_us": statistics.median(times) * 1e6,
           "p10_us": sorted(times)[30] * 1e6, "prompt_ids": 4160, "calls": 300,
           "commit": os.environ.get("PAGEDCORE_GIT_COMMIT") or subprocess.run(
               ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
               check=False).stdout.strip(),
           "machine": platform.processor() or platform.machine()}
    print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
