"""Overlap scheduling on the GPU: outputs identical to the engine without it.

    python docs/benchmarks/overlap_check.py [OUT_JSON]

Qwen2-0.5B shape (seeded random weights, bf16, triton, CUDA graphs): 48 requests of mixed
prompt lengths arriving over the first steps, greedy and seeded sampling, stop tokens taken
from a first greedy run (so requests finish on them while others start), logprobs, n = 2,
a shared prefix (hits) and a small KV budget (preemptions). Runs it with overlap off and on
and compares every token, finish reason and logprob; writes the verdict and timings.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch

from pagedcore import LLM, SamplingParams
from pagedcore.engine.models.loading import qwen2_0_5b_config


def workload(stops: list[int]) -> list[list[tuple[str, list[int], SamplingParams]]]:
    gen = torch.Generator().manual_seed(0)
    shared = torch.randint(10, 1000, (256,), generator=gen).tolist()
    arrivals: list[list[tuple[str, list[int], SamplingParams]]] = [[] for _ in range(12)]
    for i in range(48):
        n = int(torch.randint(8, 600, (1,), generator=gen))
        prompt = torch.randint(10, 1000, (n,), generator=gen).tolist()
        if i % 3 == 0:
            prompt = shared + prompt[:64]
        kind = i % 4
        if kind == 0:
            params = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=stops[:8])
        elif kind == 1:
            params = SamplingParams(max_tokens=20, temperature=0.8, seed=i, logprobs=2)
        elif kind == 2:
            params = SamplingParams(max_tokens=16, temperature=1.0, top_k=20, seed=i, n=2)
        else:
            params = SamplingParams(max_tokens=1 + i % 7, temperature=0.0, logprobs=0)
        arrivals[i % 12].append((f"r{i}", prompt, params))
    return arrivals


def run(llm: LLM, arrivals: Any) -> tuple[dict[str, Any], float]:
    done: dict[str, Any] = {}
    k = 0
    t0 = time.perf_counter()
    while k < len(arrivals) or llm.has_unfinished_requests():
        for rid, prompt, params in arrivals[k] if k < len(arrivals) else ():
            llm.add_request(rid, prompt, params)
        for out in llm.step():
            if out.finished:
                done[out.request_id] = [(list(c.token_ids), c.finish_reason,
                                         c.logprobs) for c in out.outputs]
        k += 1
    llm.drain()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return done, time.perf_counter() - t0


def main() -> None:
    out_path = sys.argv[1] if len(sys.argv) > 1 else "overlap_check.json"
    config = qwen2_0_5b_config()
    llm = LLM(config, backend="triton", kv_cache_memory_bytes=96 << 20, max_num_seqs=64,
              max_model_len=2048,
              async_scheduling=False)
    probe = llm.generate([[11, 12, 13, 14]] * 1,
                         SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    stops = sorted(set(probe[0].outputs[0].token_ids[5:40]))[:8]
    arrivals = workload(stops)
    report: dict[str, Any] = {"stop_tokens": stops}
    results = {}
    for overlap in (False, True, False, True):
        llm.set_async_scheduling(overlap)
        llm.kv_cache_manager.reset_prefix_cache()
        done, secs = run(llm, arrivals)
        key = "on" if overlap else "off"
        results.setdefault(key, []).append(done)
        report.setdefault(f"seconds_{key}", []).append(secs)
    report["preemptions"] = llm.stats()["preemptions"]
    reasons: dict[str, int] = {}
    for samples in results["off"][0].values():
        for _t, reason, _lp in samples:
            reasons[str(reason)] = reasons.get(str(reason), 0) + 1
    report["finish_reasons"] = reasons
    report["off_repeatable"] = results["off"][0] == results["off"][1]
    report["identical"] = results["on"][0] == results["off"][0]
    report["identical_tokens"] = all(
        [s[0] for s in results["on"][0][r]] == [s[0] for s in results["off"][0][r]]
        for r in results["off"][0])
    report["requests"] = len(results["off"][0])
    print(json.dumps(report, indent=2))
    with open(out_path, "w") as fh:
        json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()
