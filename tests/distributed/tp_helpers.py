"""Helpers of the tensor-parallel tests: one workload run at N=1 and N=2."""

from __future__ import annotations

from typing import Any

import torch

from pagedcore import LLM, SamplingParams
from pagedcore.engine.models.loading import tiny_config

MAX_NEW = 16


def random_prompts(lengths: list[int], *, vocab: int = 128, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def workload() -> list[list[int]]:
    """Mixed lengths (chunked under a 32-token budget) and two prompts sharing a 22-token
    prefix (prefix-cache hits)."""
    prefix = random_prompts([22], seed=7)[0]
    return [*random_prompts([3, 9, 30, 45]), [*prefix, 5, 6], [*prefix, 9]]


def params() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, logprobs=3)


def make_llm(arch: str, tp: int, *, kv_bytes: int = 1 << 20, device: str = "cpu",
             backend: str | None = None, block_size: int = 4,
             capture_sizes: list[int] | None = None, kv_cache_dtype: str = "auto",
             max_logprobs: int = 20, **overrides: Any) -> LLM:
    """A float32 engine over the seeded tiny `arch` model (same weights for any `tp`)."""
    return LLM(tiny_config(arch, **overrides), device=device, dtype=torch.float32,
               block_size=block_size,
               max_model_len=128, max_num_batched_tokens=32, long_prefill_token_threshold=16,
               kv_cache_memory_bytes=kv_bytes, seed=0, tensor_parallel_size=tp,
               backend=backend, cudagraph_capture_sizes=capture_sizes,
               kv_cache_dtype=kv_cache_dtype, max_logprobs=max_logprobs)


def assert_same_outputs(one: list[Any], two: list[Any], *, tol: float = 1e-4) -> float:
    """Tokens identical, every logprob close; returns the largest logprob difference."""
    worst = 0.0
    for i, (a, b) in enumerate(zip(one, two, strict=True)):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        assert ta == tb, f"prompt {i}: N=1 gave {ta}, N=2 gave {tb}"
        for step, (la, lb) in enumerate(zip(a.outputs[0].logprobs, b.outputs[0].logprobs,
                                            strict=True)):
            for token, value in la.items():
                diff = abs(value - lb[token])
                worst = max(worst, diff)
                assert diff < tol * max(1.0, abs(value)), (
                    f"prompt {i} step {step} token {token}: logprob {value} (N=1) vs "
                    f"{lb[token]} (N=2)"
                )
    return worst
