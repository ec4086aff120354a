"""The engine with the triton backend's fp8 cache on a GPU, against the same engine with a
16-bit cache and against the reference backend's fp8 engine.

A tiny Llama (head size 128, 4 query / 2 KV heads, initializer_range 0.1) in fp16; eight
prompts of 9-300 tokens, 24 greedy tokens each with every step's full next-token
distribution (``logprobs`` = the vocabulary); the triton engines run CUDA graphs (decode and
mixed steps) with chunked prefill over blocks of 16, so decodes and prefill chunks read the
fp8 cache across many blocks and partial last blocks. Reported (JSON on stdout and in OUT):
mean KL(16-bit || fp8) for triton and for the reference backend on the same fp8 cache
arithmetic (the oracle's own loss), KL(reference fp8 || triton fp8), where the greedy
tokens first differ, and how the triton steps ran (``step_paths``).

Usage: ``python backends/triton/tools/fp8_engine_check.py OUT.json [fp8_e4m3 ...]``
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

#: "cpu" only to try the script's logic (the reference backend, TRITON_INTERPRET=1 for triton)
DEVICE = os.environ.get("CHECK_DEVICE", "cuda")


def run(kv: str, backend: str) -> dict[str, Any]:
    import torch

    from pagedcore import LLM, SamplingParams
    from pagedcore.engine.models.loading import random_model, tiny_config

    config = tiny_config("llama", head_dim=128, hidden_size=512, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist()
               for n in (9, 300, 33, 170, 64, 17, 250, 120)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=256)
    model = random_model(config, dtype=torch.float32, device=torch.device(DEVICE), seed=0)
    llm = LLM(model, device=DEVICE, dtype="float16" if DEVICE == "cuda" else "float32",
              block_size=16, max_model_len=512,
              max_num_seqs=8, max_num_batched_tokens=128, backend=backend,
              enforce_eager=backend == "reference", kv_cache_memory_bytes=64 << 20,
              kv_cache_dtype=kv, max_logprobs=256)
    outs = llm.generate(prompts, params)
    stats = llm.stats()
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "dists": [[{t: float(v) for t, v in s.items()} for s in (o.outputs[0].logprobs or [])]
                  for o in outs],
        "step_paths": dict(stats.get("cudagraph", {}).get("step_paths", {})),
        "kv_scales": stats.get("kv_scales"),
    }


def divergence(ref: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Mean KL(ref || other) over each request's positions up to its first differing token,
    and the top-1 / top-2 gap of ref at each such token."""
    kls, gaps = [], []
    for r_tok, q_tok, r_steps, q_steps in zip(ref["tokens"], other["tokens"], ref["dists"],
                                              other["dists"], strict=True):
        for r_t, q_t, r, q in zip(r_tok, q_tok, r_steps, q_steps, strict=True):
            kls.append(sum(math.exp(lp) * (lp - q[t]) for t, lp in r.items()))
            if r_t != q_t:
                top2 = sorted(r.values(), reverse=True)[:2]
                gaps.append(round(top2[0] - top2[1], 4))
                break
    return {"mean_kl": sum(kls) / len(kls), "positions": len(kls), "flip_gaps": gaps}


def main() -> None:
    out_path = sys.argv[1]
    kvs = sys.argv[2:] or ["fp8_e4m3", "fp8_e5m2"]
    rows: dict[str, Any] = {"commit": os.environ.get("PAGEDCORE_GIT_COMMIT", "?")}
    import torch

    rows["device"] = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    t16 = run("auto", "triton")
    rows["triton_16bit_step_paths"] = t16["step_paths"]
    for kv in kvs:
        t8, r8 = run(kv, "triton"), run(kv, "reference")
        rows[kv] = {
            "triton_vs_16bit": divergence(t16, t8),
            "reference_vs_16bit": divergence(t16, r8),
            "triton_vs_reference_fp8": divergence(r8, t8),
            "triton_step_paths": t8["step_paths"],
            "kv_scales": t8["kv_scales"],
        }
        print(kv, json.dumps(rows[kv]), flush=True)
    with open(out_path, "w") as fh:
        json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
