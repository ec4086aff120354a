"""A failure inside `Scheduler.schedule()` leaves no half-scheduled state behind."""

from __future__ import annotations

from typing import Any

import pytest
from engine_helpers import assert_no_leak, make_models, random_prompts

from pagedcore import LLM, SamplingParams
from pagedcore.engine.scheduling.request import RequestStatus


def _engine() -> LLM:
    _config, _ref, eng = make_models("qwen2")
    return LLM(eng, device="cpu", block_size=4, max_model_len=96, max_num_batched_tokens=64,
               kv_cache_memory_bytes=1 << 20)


def _drain(llm: LLM) -> dict[str, Any]:
    done = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                done[out.request_id] = out
    return done


@pytest.mark.parametrize("fail_on_call", [1, 2, 4])
def test_failed_schedule_is_rolled_back(fail_on_call: int) -> None:
    prefix = random_prompts([12], seed=3)[0]
    prompts = [prefix + p for p in random_prompts([3, 6, 9, 2], seed=4)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    reference = _engine()
    expected = reference.generate(prompts, params)

    llm = _engine()
    for i, prompt in enumerate(prompts):
        llm.add_request(f"r{i}", prompt, params)
    kv = llm.kv_cache_manager
    sched = llm.scheduler
    free_before = kv.num_free_blocks
    real = kv.allocate_slots
    calls = 0

    def flaky(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == fail_on_call:
            raise RuntimeError("injected allocation failure")
        return real(*args, **kwargs)

    kv.allocate_slots = flaky  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="injected"):
        llm.step()
    # Nothing admitted, nothing counted, no block held, waiting order unchanged.
    assert not sched.running
    assert [r.request_id for r in sched.waiting] == ["r0", "r1", "r2", "r3"]
    for request in sched.waiting:
        assert request.status is RequestStatus.WAITING
        assert request.num_computed_tokens == 0 and request.num_cached_tokens is None
    assert kv.num_free_blocks == free_before
    assert sched.stats.prompt_tokens == 0 and sched.stats.prefix_hit_tokens == 0
    kv.check_invariants()

    kv.allocate_slots = real  # type: ignore[method-assign]
    done = _drain(llm)
    for i, exp in enumerate(expected):
        got = done[f"r{i}"]
        # Identical tokens: no prefix hit reached KV the failed step never wrote.
        assert got.outputs[0].token_ids == exp.outputs[0].token_ids
        assert got.num_cached_tokens == exp.num_cached_tokens
    assert_no_leak(llm)


def test_failure_mid_decode_keeps_running_requests() -> None:
    """A failure while running requests allocate: none advances, the next step recovers."""
    prompts = random_prompts([7, 4, 9], seed=5)
    # 40 tokens: past the blocks the prompt's allocation reserved ahead (4 + 16 lookahead).
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = _engine().generate(prompts, params)
    llm = _engine()
    for i, prompt in enumerate(prompts):
        llm.add_request(f"r{i}", prompt, params)
    llm.step()  # prefill all three
    sched, kv = llm.scheduler, llm.kv_cache_manager
    computed = {r.request_id: r.num_computed_tokens for r in sched.running}

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected")

    real = kv.allocate_slots
    kv.allocate_slots = broken  # type: ignore[method-assign]
    failures = 0
    for _ in range(30):  # decode steps until one needs a new block and fails
        try:
            llm.step()
        except RuntimeError:
            failures += 1
            assert {r.request_id: r.num_computed_tokens for r in sched.running} == computed
            break
        computed = {r.request_id: r.num_computed_tokens for r in sched.running}
    assert failures == 1
    kv.allocate_slots = real  # type: ignore[method-assign]
    done = _drain(llm)
    for i, exp in enumerate(expected):
        assert done[f"r{i}"].outputs[0].token_ids == exp.outputs[0].token_ids
    assert_no_leak(llm)
