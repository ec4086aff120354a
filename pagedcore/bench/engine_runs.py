"""The measurements of `pagedcore bench engine`, one function each.

Throughput of pagedcore and of transformers' `generate()` / `generate_batch()`, the host share
of step time with many running requests, CUDA graphs vs eager parity, and a preemption stress
check. The CLI in `pagedcore.bench.engine` strings them together.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "graph_parity",
    "host_share",
    "preemption_stress",
    "prompts",
    "run_hf_continuous",
    "run_hf_static",
    "run_pagedcore",
    "run_prefill",
]


def prompts(n: int, lo: int, hi: int, *, vocab: int, seed: int) -> list[list[int]]:
    """`n` prompts of random token ids (>= 10) with lengths uniform in ``[lo, hi]``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(10, vocab, (m,), generator=g).tolist() for m in lengths]


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: Any) -> tuple[Any, float]:
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - t0


def run_pagedcore(llm: Any, prompt_ids: list[list[int]], max_new: int, *,
                  warmup: list[list[int]]) -> dict[str, Any]:
    """Output tokens/s of `llm.generate` (greedy, EOS ignored), after a warm-up.

    The warm-up serves `warmup` (other prompts of the same lengths: no prefix-cache hits in
    the timed run) for 8 tokens: full-budget prefill steps, mixed steps and decodes, so
    kernels JIT-compiled per step shape (Triton) are compiled before the timed run.
    """
    from pagedcore.engine.sampling.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    llm.generate(warmup, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    steps0, host0, step0 = llm.num_steps, llm.host_time, llm.step_time
    outs, secs = _timed(lambda: llm.generate(prompt_ids, params), llm.device)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = llm.num_steps - steps0
    return {
        "tok_s": tokens / secs,
        "seconds": secs,
        "output_tokens": tokens,
        "steps": steps,
        "host_share": (llm.host_time - host0) / max(llm.step_time - step0, 1e-9),
    }


def run_prefill(llm: Any, prompt_ids: list[list[int]], *,
                warmup: list[list[int]]) -> dict[str, Any]:
    """Prompt tokens/s of `llm.generate` with one new token per prompt: a prefill-heavy
    workload (its steps are prefill chunks, no decodes), after a warm-up with other prompts of
    the same lengths (no prefix-cache hits in the timed run). ``first_tokens`` (each prompt's
    greedy token) lets runs of different backends on the same seeded model be compared."""
    from pagedcore.engine.sampling.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate(warmup, params)
    steps0 = llm.num_steps
    outs, secs = _timed(lambda: llm.generate(prompt_ids, params), llm.device)
    tokens = sum(len(p) for p in prompt_ids)
    return {
        "first_tokens": [list(o.outputs[0].token_ids)[:1] for o in outs],
        "prompt_tok_s": tokens / secs,
        "seconds": secs,
        "prompts": len(prompt_ids),
        "prompt_tokens": tokens,
        "steps": llm.num_steps - steps0,
    }


def run_hf_static(model: Any, prompt_ids: list[list[int]], max_new: int, *, batch_size: int,
                  device: Any) -> float:
    """Output tokens/s of transformers' generate() on left-padded static batches."""
    import torch

    def one_batch(batch: list[list[int]]) -> int:
        width = max(len(p) for p in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, p in enumerate(batch):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                 max_new_tokens=max_new, min_new_tokens=max_new,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        return int(out.shape[0] * (out.shape[1] - width))

    one_batch(prompt_ids[:2])  # warm-up

    def run() -> int:
        return sum(one_batch(prompt_ids[i:i + batch_size])
                   for i in range(0, len(prompt_ids), batch_size))

    tokens, secs = _timed(run, device)
    return float(tokens / secs)


def run_hf_continuous(model: Any, prompt_ids: list[list[int]], max_new: int,
                      device: Any) -> float | str:
    """Output tokens/s of transformers' generate_batch(), or why it could not run."""
    if not hasattr(model, "generate_batch"):
        return "generate_batch() not in this transformers version"
    from transformers import GenerationConfig

    config = GenerationConfig(  # type: ignore[no-untyped-call]
        max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    try:
        model.generate_batch(inputs=prompt_ids[:2], generation_config=config)
        outs, secs = _timed(lambda: model.generate_batch(inputs=prompt_ids,
                                                         generation_config=config), device)
    except Exception as exc:  # report, do not abort the whole benchmark
        return f"generate_batch() failed: {type(exc).__name__}: {exc}"[:300]
    tokens = sum(len(getattr(o, "generated_tokens", []) or []) for o in outs.values())
    return float(tokens / secs)


def host_share(llm: Any, *, num_requests: int, vocab: int, decode_steps: int,
               profile_path: str | None = None, profile_steps: int = 16) -> dict[str, Any]:
    """Share of step time spent scheduling and preparing inputs, all requests decoding (steps
    as `generate()` runs them: outputs built for finished requests only).

    Also reports each phase's mean milliseconds per step (``LLM.phase_time``: schedule,
    prepare, execute = forward + sampling, update). With `profile_path`, `profile_steps` more
    steps run under cProfile and the 30 costliest functions by cumulative time (then by own
    time) are written there as text.
    """
    from pagedcore.engine.sampling.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=decode_steps + profile_steps + 64, temperature=0.0,
                            ignore_eos=True)
    ids = [f"host-{i}" for i in range(num_requests)]
    for rid, p in zip(ids, prompts(num_requests, 32, 96, vocab=vocab, seed=11), strict=True):
        llm.add_request(rid, p, params)
    while any(r.num_output_tokens == 0 for r in llm.scheduler.running) or llm.scheduler.waiting:
        llm.step()
    running = len(llm.scheduler.running)
    for _ in range(2):  # settle (first replays, allocator)
        llm.step(finished_only=True)
    host0, step0 = llm.host_time, llm.step_time
    phases0 = dict(llm.phase_time)
    for _ in range(decode_steps):
        llm.step(finished_only=True)  # as generate() steps
    host, step = llm.host_time - host0, llm.step_time - step0
    phases = {k: round(1000 * (v - phases0[k]) / decode_steps, 4)
              for k, v in llm.phase_time.items()}
    if profile_path is not None:
        _profile_steps(llm, profile_steps, profile_path)
    for rid in ids:
        if rid in llm._parents:
            llm.abort(rid)
    return {"running_requests": running, "host_ms_per_step": 1000 * host / decode_steps,
            "step_ms": 1000 * step / decode_steps, "host_share": host / step,
            "phase_ms_per_step": phases,
            "cudagraph": llm.cudagraph_status()["enabled"]}


def _profile_steps(llm: Any, steps: int, path: str) -> None:
    """Run `steps` engine steps under cProfile; write the top 30 by cumtime and by tottime."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        llm.step(finished_only=True)
    prof.disable()
    out = io.StringIO()
    out.write(f"cProfile of {steps} steps, {len(llm.scheduler.running)} running\n")
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("cumulative").print_stats(30)
    stats.sort_stats("tottime").print_stats(30)
    with open(path, "w") as fh:
        fh.write(out.getvalue())


def graph_parity(graphs: Any, eager: Any, prompt_ids: Sequence[list[int]], *,
                 max_new: int) -> dict[str, Any]:
    """CUDA-graph decode vs eager decode on the same weights and prompts (greedy).

    Tokens are compared per request; log-probabilities (top 5 per step) are compared only
    while a request's token history is identical in both runs (after a divergence the inputs
    differ). Returns counts, the first divergence step of each diverging request, and the
    largest absolute log-probability difference while histories agree.
    """
    from pagedcore.engine.sampling.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True, logprobs=5)
    a = graphs.generate(list(prompt_ids), params)
    b = eager.generate(list(prompt_ids), params)
    identical, diverged_at, worst = 0, [], 0.0
    for x, y in zip(a, b, strict=True):
        tx, ty = x.outputs[0].token_ids, y.outputs[0].token_ids
        if tx == ty:
            identical += 1
        first = next((i for i, (p, q) in enumerate(zip(tx, ty, strict=True)) if p != q), None)
        if first is not None:
            diverged_at.append(first)
        agree = len(tx) if first is None else first + 1  # step `first` still had equal inputs
        for lx, ly in zip(x.outputs[0].logprobs[:agree], y.outputs[0].logprobs[:agree],
                          strict=True):
            common = [abs(value - ly[token]) for token, value in lx.items() if token in ly]
            # No shared top token, or a NaN: as far apart as can be.
            diffs = [d if d == d else float("inf") for d in common] or [float("inf")]
            worst = max(worst, *diffs)
    return {
        "requests": len(prompt_ids),
        "new_tokens": max_new,
        "identical_requests": identical,
        "first_divergence_steps": sorted(diverged_at),
        "max_abs_logprob_diff_while_agreeing": worst,
        "graph_replays_used": graphs.cudagraph_status()["enabled"],
    }


def preemption_stress(make: Callable[..., Any], *, num_requests: int, vocab: int,
                      tight_blocks: int) -> dict[str, Any]:
    """Outputs under a tight KV budget equal those of an unconstrained run."""
    import torch

    from pagedcore.engine.sampling.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(5)
    prompt_ids = prompts(num_requests, 8, 48, vocab=vocab, seed=7)
    lengths = torch.randint(8, 33, (num_requests,), generator=g).tolist()
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in lengths]
    free = make(kv_blocks=None)
    expected = [o.outputs[0].token_ids for o in free.generate(prompt_ids, params)]
    tight = make(kv_blocks=tight_blocks)
    t0 = time.perf_counter()
    got = [o.outputs[0].token_ids for o in tight.generate(prompt_ids, params)]
    secs = time.perf_counter() - t0
    kv = tight.kv_cache_manager
    kv.check_invariants()
    return {
        "requests": num_requests,
        "kv_blocks": tight.kv_cache_config.num_blocks,
        "preemptions": tight.stats()["preemptions"],
        "identical_outputs": got == expected,
        "mismatched_requests": sum(a != b for a, b in zip(got, expected, strict=True)),
        "blocks_leaked": kv.num_total_blocks - kv.num_free_blocks,
        "seconds": secs,
        "cudagraph": tight.cudagraph_status()["enabled"],
    }
