"""Trace-driven simulation: paged KV blocks vs contiguous max-length preallocation.

No model runs. Requests arrive all at once (a saturated queue), are admitted first come first
served while memory allows, prefill their whole prompt in one step, then decode one token per
step until their output length is reached. Both policies get the same number of KV slots:

- *contiguous*: every running request reserves ``max_model_len`` slots up front (what a static
  KV cache of shape ``[max_batch, max_model_len]`` does);
- *paged*: the real `KVCacheManager` hands out blocks of ``block_size`` slots as tokens arrive;
  when a decode step finds no free block, the newest running request is preempted (its blocks
  freed, recomputed later).

Lengths are lognormal. The defaults give the means the vLLM paper reports for ShareGPT
(161 prompt tokens, 338 output tokens; Kwon et al., SOSP 2023, §6.1) with sigma 1.0 (a spread
chosen by us, not fitted): ``mu = ln(mean) - sigma**2 / 2``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import attrs

__all__ = ["SimResult", "TraceParams", "make_trace", "simulate_contiguous", "simulate_paged"]


@attrs.frozen(kw_only=True)
class TraceParams:
    """Workload and memory of one simulation."""

    num_requests: int = 1000
    seed: int = 0
    prompt_mean: float = 161.0
    output_mean: float = 338.0
    sigma: float = 1.0
    max_model_len: int = 2048
    block_size: int = 16
    #: KV slots (tokens) both policies get: room for this many max-length requests.
    num_max_len_requests: int = 64

    @property
    def num_slots(self) -> int:
        return self.num_max_len_requests * self.max_model_len

    def lognormal_mu(self, mean: float) -> float:
        return math.log(mean) - self.sigma**2 / 2


@attrs.frozen(kw_only=True)
class SimResult:
    """What one policy achieved on a trace."""

    policy: str
    #: Time-averaged live tokens / reserved slots (only steps with running requests).
    live_fraction: float
    max_concurrent: int
    mean_concurrent: float
    #: Mean running requests over the steps where requests were still waiting (saturated).
    mean_concurrent_saturated: float
    steps: int
    preemptions: int


def make_trace(params: TraceParams) -> list[tuple[int, int]]:
    """``(prompt_len, output_len)`` per request, seeded; each pair fits ``max_model_len``."""
    rng = random.Random(params.seed)
    mu_p = params.lognormal_mu(params.prompt_mean)
    mu_o = params.lognormal_mu(params.output_mean)
    trace = []
    for _ in range(params.num_requests):
        prompt = min(max(1, round(rng.lognormvariate(mu_p, params.sigma))),
                     params.max_model_len - 1)
        output = min(max(1, round(rng.lognormvariate(mu_o, params.sigma))),
                     params.max_model_len - prompt)
        trace.append((prompt, output))
    return trace


class _SimRequest:
    """A request as the KV-cache manager sees it; tokens are dummies."""

    __slots__ = ("cache_salt", "lora_name", "num_computed_tokens", "output_len",
                 "prompt_len", "request_id", "tokens")

    def __init__(self, index: int, prompt_len: int, output_len: int) -> None:
        self.request_id = f"r{index}"
        self.prompt_len = prompt_len
        self.output_len = output_len
        self.tokens = [0] * prompt_len
        self.num_computed_tokens = 0
        self.cache_salt: str | None = None
        self.lora_name: str | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.tokens

    @property
    def num_prompt_tokens(self) -> int:
        return self.prompt_len

    @property
    def done(self) -> bool:
        return len(self.tokens) - self.prompt_len >= self.output_len


def simulate_contiguous(params: TraceParams, trace: Sequence[tuple[int, int]]) -> SimResult:
    """Every running request holds ``max_model_len`` slots from admission to finish."""
    capacity = params.num_slots // params.max_model_len
    # A request admitted at step s holds prompt + t tokens at step s + t, finishing when
    # t == output_len. Batches start together and are refilled as requests finish.
    waiting = list(reversed(trace))
    running: list[list[int]] = []  # [tokens in cache, tokens at finish]
    live_sum = reserved_sum = 0
    steps = peak = concurrent_sum = saturated_sum = saturated_steps = 0
    while waiting or running:
        while waiting and len(running) < capacity:
            prompt, output = waiting.pop()
            running.append([prompt, prompt + output])
        steps += 1
        peak = max(peak, len(running))
        concurrent_sum += len(running)
        if waiting:
            saturated_steps += 1
            saturated_sum += len(running)
        live_sum += sum(r[0] for r in running)
        reserved_sum += len(running) * params.max_model_len
        for r in running:
            r[0] += 1
        running = [r for r in running if r[0] < r[1]]
    return SimResult(
        policy="contiguous",
        live_fraction=live_sum / reserved_sum,
        max_concurrent=peak,
        mean_concurrent=concurrent_sum / steps,
        mean_concurrent_saturated=saturated_sum / max(1, saturated_steps),
        steps=steps,
        preemptions=0,
    )


def simulate_paged(params: TraceParams, trace: Sequence[tuple[int, int]]) -> SimResult:
    """The real `KVCacheManager` (prefix caching off: prompts are unrelated)."""
    from pagedcore.kv_cache.manager import KVCacheManager
    from pagedcore.kv_cache.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    bs = params.block_size
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=8, dtype="float16")
    config = KVCacheConfig(
        num_blocks=params.num_slots // bs + 1,  # + the null block: same usable slots
        groups=(KVCacheGroupSpec(layer_names=("model.layers.0.self_attn",), spec=spec),),
    )
    mgr = KVCacheManager(config, params.max_model_len, enable_caching=False)
    waiting = [_SimRequest(i, p, o) for i, (p, o) in reversed(list(enumerate(trace)))]
    running: list[_SimRequest] = []
    blocks_of = mgr.coordinator.managers[0].req_to_blocks
    live_sum = reserved_sum = 0
    steps = peak = concurrent_sum = preemptions = saturated_sum = saturated_steps = 0
    while waiting or running:
        # Decode: one new slot for the token sampled last step; preempt the newest on failure.
        i = 0
        while i < len(running):
            req = running[i]
            if mgr.allocate_slots(req, 1) is not None:
                req.num_computed_tokens += 1
                i += 1
                continue
            victim = running.pop()
            mgr.free(victim)
            victim.num_computed_tokens = 0
            waiting.append(victim)
            preemptions += 1
        # Admit (prefill everything known) while it fits, but never ahead of a preempted one.
        while waiting:
            req = waiting[-1]
            num = len(req.tokens)
            if mgr.allocate_slots(req, num) is None:
                break
            req.num_computed_tokens = num
            running.append(waiting.pop())
        if not running:
            raise RuntimeError("a request does not fit in the whole KV cache")
        steps += 1
        peak = max(peak, len(running))
        concurrent_sum += len(running)
        if waiting:
            saturated_steps += 1
            saturated_sum += len(running)
        live_sum += sum(r.num_computed_tokens for r in running)
        reserved_sum += bs * sum(len(blocks_of[r.request_id]) for r in running)
        # Sample one token each; retire finished requests.
        still = []
        for req in running:
            req.tokens.append(0)
            if req.done:
                mgr.free(req)
            else:
                still.append(req)
        running = still
    mgr.check_invariants()
    return SimResult(
        policy="paged",
        live_fraction=live_sum / reserved_sum,
        max_concurrent=peak,
        mean_concurrent=concurrent_sum / steps,
        mean_concurrent_saturated=saturated_sum / max(1, saturated_steps),
        steps=steps,
        preemptions=preemptions,
    )
