"""A failing step (backend, model runner) and an abandoned stream leave the engine serving:
failed requests end with finish_reason "error" and their tokens, no block leaks, no prefix
hit on KV the failed step never wrote, and later requests still match transformers."""

from __future__ import annotations

from typing import Any

import pytest
from engine_helpers import assert_no_leak, hf_greedy, make_models, random_prompts

from pagedcore import LLM, SamplingParams
from pagedcore.engine.errors import EngineStepError

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def models() -> tuple[Any, Any]:
    """(transformers reference model, engine model) with the same weights."""
    _config, ref, eng = make_models("llama")
    return ref, eng


def make_llm(eng: Any, **kw: Any) -> LLM:
    return LLM(eng, device="cpu", block_size=4, max_model_len=48, max_num_batched_tokens=32,
               kv_cache_memory_bytes=1 << 20, **kw)


def expected(ref: Any, prompt: list[int]) -> list[int]:
    return hf_greedy(ref, prompt, MAX_NEW)[0]


class Boom(ValueError):
    pass


def test_backend_failure_mid_forward_finishes_step_with_error(
    models: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    ref, eng = models
    llm = make_llm(eng, max_num_seqs=2)
    p_a, p_c, p_d = random_prompts([9, 13, 7], seed=21)
    # Layer 1 of the attention raises, after layer 0 wrote this step's KV: partial writes.
    impl = llm.runner.layers[1].impl
    real_forward = impl.forward
    armed = False

    def forward(*args: Any, **kwargs: Any) -> Any:
        if armed:
            raise Boom("backend exploded in layer 1")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(impl, "forward", forward)
    llm.add_request("a", p_a, GREEDY)
    for _ in range(3):  # prefill + 2 decodes: 3 tokens
        llm.step()
    llm.add_request("c", p_c, GREEDY)  # prefilled in the failing step: 3 full blocks cached
    llm.add_request("d", p_d, GREEDY)  # max_num_seqs=2: waits, untouched by the failure
    armed = True
    with pytest.raises(EngineStepError) as info:
        llm.step()
    armed = False
    message = str(info.value)
    assert "engine step 3 failed with Boom: backend exploded in layer 1" in message, message
    assert "'a', 'c'" in message and "'d'" not in message, message
    assert isinstance(info.value.__cause__, Boom)
    outs = {o.request_id: o for o in info.value.outputs}
    assert sorted(outs) == ["a", "c"]
    ref_a = expected(ref, p_a)
    for rid, tokens in (("a", ref_a[:3]), ("c", [])):
        out = outs[rid]
        assert out.finished and out.outputs[0].finish_reason == "error"
        assert out.outputs[0].token_ids == tokens  # what it produced before the failure
        assert out.error == "Boom: backend exploded in layer 1"
    assert set(llm.scheduler.requests) == {"d"}

    # "d" was waiting and keeps going; the failed ids are free again.
    finished = []
    while llm.has_unfinished_requests():
        finished += [o for o in llm.step() if o.finished]
    assert [o.request_id for o in finished] == ["d"]
    assert finished[0].outputs[0].token_ids == expected(ref, p_d)
    assert_no_leak(llm)

    # Same prompts again: only KV written by successful steps may be hit. "a"'s prompt blocks
    # (step 0) are valid: 8 tokens hit. "c"'s blocks and "a"'s third block were cached by the
    # failed step but never written: no hit on them.
    p_a_long = [*p_a, *ref_a[:3], 7]
    outs2 = llm.generate([p_a_long, p_c], GREEDY)  # max_num_seqs=2: both at once
    assert [o.num_cached_tokens for o in outs2] == [8, 0]
    for prompt, out in zip([p_a_long, p_c], outs2, strict=True):
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == expected(ref, prompt)
    assert_no_leak(llm)


def test_runner_failure_in_generate_raises_and_engine_keeps_serving(
    models: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    ref, eng = models
    llm = make_llm(eng)
    prompts = random_prompts([5, 10, 8], seed=22)  # all fit the first step
    real_execute = llm.runner.execute
    calls = 0

    def execute(inputs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 4:
            raise RuntimeError("model runner died")
        return real_execute(inputs)

    monkeypatch.setattr(llm.runner, "execute", execute)
    params = [GREEDY, GREEDY.replace(max_tokens=2), GREEDY.replace(n=2)]
    with pytest.raises(EngineStepError, match="RuntimeError: model runner died") as info:
        llm.generate(prompts, params)
    outs = info.value.outputs
    assert [o.request_id for o in outs] == ["gen-0", "gen-1", "gen-2"]  # one per prompt
    # Steps 1-3 ran: prompts 0 and 2 got 3 tokens, prompt 1 finished after 2.
    assert outs[1].outputs[0].finish_reason == "length" and outs[1].error is None
    assert outs[1].outputs[0].token_ids == expected(ref, prompts[1])[:2]
    for i in (0, 2):
        assert outs[i].error == "RuntimeError: model runner died"
        ref_tokens = expected(ref, prompts[i])[:3]
        assert [c.finish_reason for c in outs[i].outputs] == ["error"] * len(outs[i].outputs)
        assert [c.token_ids for c in outs[i].outputs] == [ref_tokens] * len(outs[i].outputs)
    assert len(outs[2].outputs) == 2
    assert not llm.has_unfinished_requests()
    assert_no_leak(llm)

    again = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in again] == [expected(ref, p) for p in prompts]
    assert_no_leak(llm)


def test_interrupt_in_generate_leaves_nothing_behind(
    models: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    _ref, eng = models
    llm = make_llm(eng)
    steps = 0

    def on_step(outs: Any) -> None:
        nonlocal steps
        steps += 1
        if steps == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        llm.generate(random_prompts([6, 9], seed=23), GREEDY, on_step=on_step)
    assert not llm.has_unfinished_requests()
    assert_no_leak(llm)


def test_closing_a_stream_early_aborts_its_requests(models: tuple[Any, Any]) -> None:
    ref, eng = models
    llm = make_llm(eng)
    prompts = random_prompts([6, 11], seed=24)
    # break out of the loop (the generator is closed when it is dropped)
    for out in llm.stream(prompts, GREEDY):
        assert not out.finished
        break
    assert not llm.has_unfinished_requests()
    assert_no_leak(llm)
    # explicit close() after a few outputs, with another request of the caller still running
    llm.add_request("other", prompts[0], GREEDY)
    stream = llm.stream(prompts[1], GREEDY)
    first = [next(stream) for _ in range(3)]
    assert {o.request_id for o in first} == {"gen-2"}
    stream.close()
    assert set(llm.scheduler.requests) == {"other"}  # only the stream's request was aborted
    done = []
    while llm.has_unfinished_requests():
        done += [o for o in llm.step() if o.finished]
    assert [o.request_id for o in done] == ["other"]
    assert done[0].outputs[0].token_ids == expected(ref, prompts[0])
    assert_no_leak(llm)


def test_tensor_parallel_failure_stops_engine_and_finishes_everything(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pagedcore.engine.distributed.executor import TensorParallelExecutor
    from pagedcore.engine.distributed.group import TensorParallelError
    from pagedcore.engine.models.loading import tiny_config

    llm = LLM(tiny_config("llama"), device="cpu", block_size=4, max_model_len=48,
              max_num_batched_tokens=32, max_num_seqs=2, kv_cache_memory_bytes=1 << 20,
              tensor_parallel_size=2)
    ex = llm.runner
    assert isinstance(ex, TensorParallelExecutor) and ex.runner is not None
    try:
        prompts = random_prompts([6, 9, 5], seed=25)
        llm.generate(prompts[:1], GREEDY)

        def broken(inputs: Any) -> None:
            raise ValueError("rank 0 broke")

        monkeypatch.setattr(ex.runner, "execute", broken)
        llm.add_request("waiting", prompts[2], GREEDY)  # not in the failing step
        with pytest.raises(TensorParallelError, match="rank 0 failed: ValueError: rank 0 broke"):
            llm.generate(prompts[:2], GREEDY)
        # The engine is stopped: every request it held is finished, nothing leaks or hangs.
        assert not llm.has_unfinished_requests()
        assert_no_leak(llm)
        llm.add_request("late", prompts[0], GREEDY)
        with pytest.raises(TensorParallelError, match="engine is stopped"):
            llm.step()
        assert not llm.has_unfinished_requests()
        assert_no_leak(llm)
    finally:
        ex.shutdown()
