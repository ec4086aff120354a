"""Bucket-aware chunked prefill: with ``SchedulerConfig.token_buckets`` a partial prefill
chunk is shrunk so its step totals exactly a token bucket (the size a captured mixed-step
graph runs without padding); final chunks, small chunks and engines without buckets are left
alone, and outputs do not change."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_helpers import assert_no_leak, make_models, random_prompts
from test_scheduler import assert_clean, make_scheduler, req, run_all, run_step

from pagedcore.engine.llm import LLM
from pagedcore.engine.sampling.sampling_params import SamplingParams
from pagedcore.engine.scheduling.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

BUCKETS = (16, 32, 48, 64)


def _mixed_run(**config: Any) -> tuple[Scheduler, list[SchedulerOutput]]:
    """Four short requests decoding while a 150-token prompt is chunked at threshold 30."""
    s = make_scheduler(num_blocks=200, max_model_len=256, max_num_batched_tokens=64,
                       long_prefill_token_threshold=30, **config)
    for i in range(4):
        s.add_request(req(f"s{i}", 3, max_tokens=60))
    steps = [run_step(s)]
    s.add_request(req("long", 150, max_tokens=2))
    steps += run_all(s)
    return s, steps


def _long_chunk(step: SchedulerOutput) -> Any:
    return next((x for x in step.scheduled if x.request.request_id == "long"), None)


def test_partial_chunk_steps_land_on_buckets() -> None:
    s, steps = _mixed_run(token_buckets=BUCKETS)
    chunks = [(step, c) for step in steps if (c := _long_chunk(step)) is not None
              and c.num_new_tokens > 1]
    partial = [(step, c) for step, c in chunks if not c.samples]
    assert len(partial) >= 4
    # 4 decodes + 30 prompt tokens = 34 would pad to 48: cut to 28, the step totals 32.
    for step, chunk in partial:
        assert step.num_scheduled_tokens in BUCKETS, step
        assert step.num_scheduled_tokens == 32 and chunk.num_new_tokens == 28
    # The final chunk completes the prompt, whatever the step totals.
    _final_step, final = chunks[-1]
    assert final.samples and final.end == 150
    assert final.num_new_tokens == 150 - 28 * len(partial)
    # Tokens computed once each, in order.
    ends = [c.start for _, c in chunks] + [150]
    assert all(c.end == nxt for (_, c), nxt in zip(chunks, ends[1:], strict=True))
    assert_clean(s)


def test_unaligned_without_buckets() -> None:
    """The same run without buckets: 34-token steps (what the aligned run avoids)."""
    s, steps = _mixed_run()
    assert s.config.token_buckets is None
    totals = [step.num_scheduled_tokens for step in steps
              if (c := _long_chunk(step)) is not None and not c.samples]
    assert totals and all(t == 34 for t in totals)
    assert_clean(s)


def test_no_shrink_below_half_or_of_final_chunk() -> None:
    # Bucket 16 below 34 would leave 12 of 30 tokens: below half, so the chunk stays 30.
    _s, steps = _mixed_run(token_buckets=(16, 64))
    partial = [c for step in steps if (c := _long_chunk(step)) is not None and not c.samples]
    assert partial and all(c.num_new_tokens == 30 for c in partial)
    # A prompt whose only chunk is its final one is never cut (9 tokens over bucket 16).
    s = make_scheduler(max_num_batched_tokens=64, token_buckets=(16, 32))
    s.add_request(req("a", 25, max_tokens=1))
    out = run_step(s)
    assert [(x.num_new_tokens, x.samples) for x in out.scheduled] == [(25, True)]
    # Above the largest bucket the step runs eagerly, unpadded: no cut either.
    s = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=40,
                       token_buckets=(16, 32))
    s.add_request(req("b", 60, max_tokens=1))
    assert run_step(s).scheduled[0].num_new_tokens == 40


def test_budget_limited_chunk_is_aligned() -> None:
    """A chunk cut by the token budget (no threshold) lands on the bucket below the budget."""
    s = make_scheduler(max_model_len=128, max_num_batched_tokens=40, token_buckets=BUCKETS)
    s.add_request(req("a", 100, max_tokens=1))
    first = run_step(s)
    assert first.num_scheduled_tokens == 32 and not first.scheduled[0].samples
    run_all(s)
    assert_clean(s)


def test_shrunk_blocks_are_cached_again() -> None:
    """The blocks allocated for the cut tokens lose their prefix-cache entries until written,
    then are registered again: a second identical prompt hits every full block."""
    # 4 decodes + 30 tokens = 34 -> bucket 24: each partial chunk is cut to 20 tokens, past
    # 4-token block boundaries (blocks 5 and 6 of the first chunk were allocated and cached).
    s = make_scheduler(num_blocks=200, max_model_len=256, max_num_batched_tokens=64,
                       long_prefill_token_threshold=30, token_buckets=(16, 24, 64))
    prompt = list(range(5000, 5150))
    for i in range(4):
        s.add_request(req(f"s{i}", 3, max_tokens=60))
    run_step(s)
    s.add_request(req("long", prompt, max_tokens=1))
    seen_cut = False
    while "long" in s.requests:
        out = run_step(s)
        chunk = _long_chunk(out)
        seen_cut |= chunk is not None and chunk.num_new_tokens == 20
    assert seen_cut
    again = req("again", prompt, max_tokens=1)
    s.add_request(again)
    run_step(s)
    assert again.num_cached_tokens == 148  # every full block of the 150-token prompt
    run_all(s)
    assert_clean(s)


def test_config_validation() -> None:
    assert SchedulerConfig().token_buckets is None
    for bad in [(), (16, 16), (32, 16), (0, 16), [16, 32]]:
        with pytest.raises(ValueError, match="token_buckets"):
            SchedulerConfig(token_buckets=bad)  # type: ignore[arg-type]


def _engine_run(align: Any) -> tuple[list[list[int]], list[int], LLM]:
    _c, _r, eng = make_models("llama")
    llm = LLM(eng, device="cpu", dtype=torch.float32, block_size=4, max_model_len=160,
              max_num_batched_tokens=64, long_prefill_token_threshold=30,
              kv_cache_memory_bytes=1 << 21, align_chunks_to_buckets=align)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    shorts = random_prompts([5, 7, 3, 6], seed=3)
    long = random_prompts([120], seed=4)[0]
    for i, p in enumerate(shorts):
        llm.add_request(f"s{i}", p, params)
    outputs: dict[str, list[int]] = {}
    totals: list[int] = []
    added = False
    while llm.scheduler.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        totals.append(llm.last_step_num_scheduled_tokens)
        if not added:  # the long prompt arrives once the shorts decode
            llm.add_request("long", long, params)
            added = True
    return [outputs[k] for k in sorted(outputs)], totals, llm


def test_engine_outputs_identical_and_steps_on_buckets() -> None:
    """Greedy outputs of a tiny model (reference backend, CPU) are token-identical with and
    without alignment; aligned, every step carrying a partial chunk totals a bucket."""
    base_out, base_totals, base = _engine_run(False)
    assert base.scheduler.config.token_buckets is None  # CPU: no graphs, nothing changes
    out, totals, llm = _engine_run(BUCKETS)
    assert llm.scheduler.config.token_buckets == BUCKETS
    assert out == base_out
    assert 34 in base_totals and 34 not in totals  # 4 decodes + a 30-token chunk
    assert totals.count(32) >= 3
    assert len(totals) > len(base_totals)
    # Default (True) on CPU: no mixed graphs, so no buckets and the schedule is unchanged.
    _o, default_totals, default = _engine_run(True)
    assert default.scheduler.config.token_buckets is None and default_totals == base_totals
    for engine in (base, llm, default):
        assert_no_leak(engine)


@pytest.mark.parametrize("shared", ["n=2", "two requests"])
def test_no_cut_under_a_prefix_hit_taken_in_the_same_step(shared: str) -> None:
    """A chunk [0, 18) registers its first block in the prefix cache; a request admitted in
    the same step hits that block and computes [16, 19). Aligning the step to bucket 16 by
    cutting the chunk to [0, 13) would leave slots 13-15 unwritten while the other request
    reads them (wrong tokens, found by a randomized differential run): the shared chunk is
    not a candidate, so the step stays unaligned and both requests match the engine without
    alignment (logits too)."""
    model = make_models("llama")[2]
    prompt = list(range(10, 29))  # 19 tokens: one full block of 16 and 3 more
    kw: dict[str, Any] = dict(device="cpu", block_size=16, max_model_len=64,
                              max_num_batched_tokens=24, long_prefill_token_threshold=18,
                              kv_cache_memory_bytes=1 << 20)
    if shared == "n=2":
        prompts: list[Any] = [prompt]
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, n=2,
                                logprobs=3)
    else:
        prompts = [prompt, [*prompt[:16], 40, 41, 42]]
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)

    def run(align: Any) -> list[Any]:
        llm = LLM(model, align_chunks_to_buckets=align, **kw)
        outs = [c for o in llm.generate(prompts, params) for c in o.outputs]
        assert_no_leak(llm)
        return outs

    want, got = run(False), run([8, 16, 32])
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for a, b in zip(got, want, strict=True):
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.keys() == y.keys()
            assert all(abs(x[t] - y[t]) < 1e-4 for t in x)
