"""Overlap scheduling (`LLM(async_scheduling=True)`) gives the outputs of the engine without it:
greedy and seeded sampling, logprobs, n > 1, stop tokens and EOS finishing requests while
others start, chunked prefill, prefix hits, preemption storms, aborts with a token in flight,
CUDA graphs (decode and mixed, replayed eagerly on the CPU) and a failing step. No block
leaks and no output holds a discarded speculative token."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from engine_helpers import assert_no_leak, make_models, random_prompts

from pagedcore import LLM, SamplingParams
from pagedcore.engine.errors import EngineStepError
from pagedcore.engine.runner.overlap import (
    ASYNC_SCHEDULING_ENV,
    async_scheduling_setting,
    resolve_placeholders,
)


@pytest.fixture(scope="module")
def model() -> Any:
    return make_models("llama")[2]


def _llm(model: Any, overlap: bool, **kw: Any) -> LLM:
    args: dict[str, Any] = dict(device="cpu", block_size=4, max_model_len=64,
                                max_num_batched_tokens=32, kv_cache_memory_bytes=1 << 20)
    args.update(kw)
    llm = LLM(copy.deepcopy(model), async_scheduling=overlap, **args)
    assert llm.async_scheduling is overlap
    return llm


def _run(llm: LLM, arrivals: list[list[tuple[str, list[int], SamplingParams]]],
         aborts: dict[int, str] | None = None) -> dict[str, Any]:
    """Add ``arrivals[k]`` before step call k, abort ``aborts[k]`` after it; run to the end.
    Returns every finished output by id: (tokens, finish reason, logprobs) per sample."""
    done: dict[str, Any] = {}
    k = 0
    while k < len(arrivals) or llm.has_unfinished_requests():
        for rid, prompt, params in arrivals[k] if k < len(arrivals) else ():
            llm.add_request(rid, prompt, params)
        outs = llm.step()
        if aborts and k in aborts:
            outs.append(llm.abort(aborts[k]))
        for out in outs:
            if out.finished:
                assert out.request_id not in done, "finished twice"
                done[out.request_id] = [
                    (list(c.token_ids), c.finish_reason, c.logprobs) for c in out.outputs
                ]
        k += 1
    llm.drain()
    return done


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Tokens and finish reasons equal; logprobs equal up to float noise (a preempted
    request's recomputation runs in other batches than without overlap)."""
    assert sorted(got) == sorted(want)
    for rid, samples in want.items():
        assert [s[:2] for s in got[rid]] == [s[:2] for s in samples], rid
        for (_t, _r, lp_got), (_t2, _r2, lp_want) in zip(got[rid], samples, strict=True):
            if lp_want is None:
                assert lp_got is None
                continue
            for g, w in zip(lp_got, lp_want, strict=True):
                assert g.keys() == w.keys()
                assert all(abs(g[k] - w[k]) <= 1e-4 for k in w), (rid, g, w)


def _both(model: Any, arrivals: Any, **kw: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    sync = _llm(model, False, **kw)
    fast = _llm(model, True, **kw)
    a, b = _run(sync, arrivals), _run(fast, arrivals)
    assert_no_leak(sync)
    assert_no_leak(fast)
    return a, b


def _stop_tokens(model: Any, prompts: list[list[int]], at: int) -> list[int]:
    """The greedy token each prompt produces at output position `at` (to stop on it)."""
    llm = _llm(model, False)
    outs = llm.generate(prompts, SamplingParams(max_tokens=at + 1, temperature=0.0,
                                                ignore_eos=True))
    return [o.outputs[0].token_ids[at] for o in outs]


def test_switch_defaults_env_override_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ASYNC_SCHEDULING_ENV, raising=False)
    assert async_scheduling_setting(None, device_type="cuda") == (True, None)
    on, why = async_scheduling_setting(None, device_type="cpu")
    assert not on and why is not None and "CPU" in why
    assert async_scheduling_setting(True, device_type="cpu") == (True, None)
    monkeypatch.setenv(ASYNC_SCHEDULING_ENV, "0")
    assert not async_scheduling_setting(True, device_type="cuda")[0]
    monkeypatch.setenv(ASYNC_SCHEDULING_ENV, "1")
    assert async_scheduling_setting(False, device_type="cpu") == (True, None)
    monkeypatch.setenv(ASYNC_SCHEDULING_ENV, "maybe")
    with pytest.raises(ValueError, match="PAGEDCORE_ASYNC_SCHEDULING='maybe' is not a switch"):
        async_scheduling_setting(None, device_type="cpu")
    with pytest.raises(ValueError, match="is not a switch; set it to 1"):
        LLM("demo", device="cpu")
    monkeypatch.delenv(ASYNC_SCHEDULING_ENV)
    with pytest.raises(TypeError, match="async_scheduling must be True, False or None"):
        LLM("demo", device="cpu", async_scheduling="yes")  # type: ignore[arg-type]


def test_placeholders_resolve_on_the_device_side() -> None:
    ids = torch.tensor([5, -2, 0, -1, 7, -3])
    resolve_placeholders(ids, torch.tensor([11, 12, 13]))
    assert ids.tolist() == [5, 12, 0, 11, 7, 13]


def test_greedy_with_stops_eos_and_staggered_arrivals_matches(model: Any) -> None:
    prompts = random_prompts([5, 9, 14, 3, 21, 7, 11, 6], seed=3)
    stops = _stop_tokens(model, prompts, 2)
    arrivals: list[list[Any]] = [[] for _ in range(8)]
    for i, prompt in enumerate(prompts):
        # Stop tokens, EOS (the stop token as the model's EOS via stop_token_ids), max_tokens
        # of 1..12, arriving every step so finishes and starts share steps.
        params = SamplingParams(
            max_tokens=1 + (i * 5) % 12, temperature=0.0,
            stop_token_ids=[stops[i]] if i % 2 == 0 else [], ignore_eos=True,
        )
        arrivals[i % 8].append((f"r{i}", prompt, params))
    sync, fast = _both(model, arrivals, max_num_seqs=4)
    assert fast == sync
    reasons = [s[0][1] for s in sync.values()]
    assert "stop" in reasons and "length" in reasons
    for rid, samples in fast.items():
        i = int(rid[1:])
        tokens, reason, _ = samples[0]
        if reason == "stop":  # ends at its stop token: nothing sampled after it was kept
            assert tokens[-1] == stops[i] and tokens.count(stops[i]) == 1
        assert len(tokens) <= 1 + (i * 5) % 12


def test_seeded_n_logprobs_prefix_hits_and_chunks_match(model: Any) -> None:
    shared = random_prompts([24], seed=5)[0]
    tails = random_prompts([3, 6, 9, 2], seed=6)
    params = [
        SamplingParams(max_tokens=7, temperature=0.8, seed=11, n=3, logprobs=2),
        SamplingParams(max_tokens=9, temperature=1.0, top_k=5, seed=12, logprobs=0),
        SamplingParams(max_tokens=6, temperature=0.7, top_p=0.9, seed=13),
        SamplingParams(max_tokens=8, temperature=0.0, logprobs=3),
    ]
    arrivals: list[list[Any]] = [[], [], [], []]
    for i, (tail, p) in enumerate(zip(tails, params, strict=True)):
        arrivals[i if i < 2 else 3].append((f"p{i}", shared + tail, p))
    # 16-token budget: the 27..33-token prompts are chunked; the later ones hit the prefix.
    sync, fast = _both(model, arrivals, max_num_batched_tokens=16, max_num_seqs=6)
    _same(fast, sync)
    assert len(fast["p0"]) == 3 and all(s[2] is not None for s in fast["p0"])


def test_preemption_storm_matches(model: Any) -> None:
    prompts = random_prompts([13, 17, 9, 21, 11, 15, 19, 8], seed=9)
    arrivals = [[(f"q{i}", p, SamplingParams(max_tokens=14, temperature=0.0,
                                              ignore_eos=True))
                 for i, p in enumerate(prompts)]]
    # ~40 blocks of 4 tokens for 8 requests of up to 35 tokens: preempted over and over.
    sync = _llm(model, False, kv_cache_memory_bytes=40 * 4 * 2 * 4 * 16 * 2 * 2)
    fast = _llm(model, True, kv_cache_memory_bytes=40 * 4 * 2 * 4 * 16 * 2 * 2)
    a, b = _run(sync, arrivals), _run(fast, arrivals)
    assert sync.stats()["preemptions"] > 0 and fast.stats()["preemptions"] > 0
    _same(b, a)
    assert_no_leak(sync)
    assert_no_leak(fast)


def test_preempted_alone_with_a_token_in_flight_matches(model: Any) -> None:
    # A cache of one max_model_len request: the only running request is preempted while its
    # token is in flight and the next step is empty (its placeholder must not wedge it).
    probe = _llm(model, False)
    group = probe.kv_cache_config.groups[0]
    per_block = group.spec.page_size_bytes * len(group.layer_names)
    budget = (1 + 64 // 4) * per_block
    prompts = random_prompts([12, 25, 7, 19, 30, 14, 22, 9], seed=3)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    arrivals = [[(f"s{i}", p, params) for i, p in enumerate(prompts)]]
    sync = _llm(model, False, kv_cache_memory_bytes=budget)
    fast = _llm(model, True, kv_cache_memory_bytes=budget)
    _same(_run(fast, arrivals), _run(sync, arrivals))
    assert fast.stats()["preemptions"] >= 2
    assert_no_leak(fast)


def test_abort_with_a_token_in_flight(model: Any) -> None:
    prompts = random_prompts([7, 10, 5], seed=4)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    arrivals = [[(f"a{i}", p, params) for i, p in enumerate(prompts)]]
    full = _run(_llm(model, False), arrivals)
    fast = _llm(model, True)
    got = _run(fast, arrivals, aborts={3: "a1"})
    tokens, reason, _ = got["a1"][0]
    assert reason == "abort"
    # Aborted while its 4th token was in flight: it keeps the 3 it had, a prefix of the run.
    assert tokens == full["a1"][0][0][:3]
    assert got["a0"] == full["a0"] and got["a2"] == full["a2"]
    assert_no_leak(fast)


def test_decode_and_mixed_graphs_match_with_overlap(model: Any) -> None:
    from mixed_graph_backend import mixed_backend_registered

    from pagedcore.engine.runner.cuda_graph import EagerCapturer

    prompts = random_prompts([5, 23, 9, 14, 3, 30], seed=8)
    params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    arrivals: list[list[Any]] = [[(f"g{i}", p, params)] for i, p in enumerate(prompts)]
    kw: dict[str, Any] = dict(max_model_len=96, max_num_seqs=8, max_num_batched_tokens=64,
                              long_prefill_token_threshold=16, kv_cache_memory_bytes=1 << 21)
    with mixed_backend_registered() as name:
        sync = _llm(model, False, backend=name, **kw)
        fast = _llm(model, True, backend=name, **kw)
        for llm in (sync, fast):
            assert llm.runner.enable_cudagraphs(capturer=EagerCapturer(), sizes=[1, 2, 4, 8]) \
                is None
        replays = fast.runner.graphs.replay
        counted = {"n": 0}

        def counting(bucket: int) -> Any:
            counted["n"] += 1
            return replays(bucket)

        fast.runner.graphs.replay = counting  # type: ignore[method-assign]
        assert _run(fast, arrivals) == _run(sync, arrivals)
        assert counted["n"] > 0  # decode steps replayed their graphs with placeholders
        assert_no_leak(fast)


def test_failing_step_with_overlap_finishes_its_requests_and_keeps_serving(
    model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    p_a, p_b, p_c = random_prompts([9, 6, 7], seed=21)
    expected = _run(_llm(model, False), [[("a", p_a, greedy), ("c", p_c, greedy)]])
    llm = _llm(model, True, max_num_seqs=2)
    impl = llm.runner.layers[1].impl
    real = impl.forward
    armed = False

    def forward(*args: Any, **kwargs: Any) -> Any:
        if armed:
            raise ValueError("backend exploded")
        return real(*args, **kwargs)

    monkeypatch.setattr(impl, "forward", forward)
    llm.add_request("a", p_a, greedy)
    for _ in range(3):  # launches steps 0..2; steps 0 and 1 are finished on the host
        llm.step()
    llm.add_request("b", p_b, greedy)
    llm.add_request("c", p_c, greedy)  # max_num_seqs=2: waits, untouched by the failure
    armed = True
    with pytest.raises(EngineStepError) as info:
        llm.step()
    armed = False
    assert "engine step 3 failed with ValueError: backend exploded" in str(info.value)
    outs = {o.request_id: o for o in info.value.outputs}
    assert sorted(outs) == ["a", "b"]
    # Step 2's token of "a" landed before step 3 failed: 3 tokens, all of the real run.
    assert outs["a"].outputs[0].token_ids == expected["a"][0][0][:3]
    assert outs["a"].outputs[0].finish_reason == "error"
    assert outs["b"].outputs[0].token_ids == []
    rest = _run(llm, [])
    assert rest == {"c": expected["c"]}
    assert_no_leak(llm)


def test_failure_in_the_host_half_one_step_behind(
    model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = _llm(model, True)
    llm.add_request("a", [5, 6, 7], SamplingParams(max_tokens=6, temperature=0.0,
                                                   ignore_eos=True))

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("stop check exploded")

    monkeypatch.setattr(llm.scheduler, "update_from_output", broken)
    assert llm.step() == []  # step 0 launched; its host half runs in the next call
    with pytest.raises(EngineStepError, match="stop check exploded") as info:
        llm.step()
    assert [o.outputs[0].finish_reason for o in info.value.outputs] == ["error"]
    monkeypatch.undo()
    llm.drain()  # the step launched meanwhile held only "a": its token is dropped
    assert not llm.has_unfinished_requests()
    assert_no_leak(llm)


@pytest.mark.parametrize("overlap", [False, True])
def test_finished_requests_leave_the_overlap_bookkeeping(model: Any, overlap: bool) -> None:
    """Requests with prompt logprobs or logits processors (``min_tokens`` here) are tracked
    for the overlap path; with overlap off nothing pruned them, so every such request stayed
    referenced for the engine's life (found by a randomized differential run)."""
    llm = _llm(model, overlap, block_size=4, max_model_len=64)
    for _ in range(5):
        llm.generate([[5, 6, 7, 8, 9, 10]],
                     [SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1,
                                     min_tokens=1)])
    assert not llm._prompt_pending and not llm._processing_ids
    # An abort lets go of them at once (no later step has to prune them).
    llm.add_request("a", [5, 6, 7, 8], SamplingParams(max_tokens=8, min_tokens=4,
                                                      prompt_logprobs=1, n=2))
    llm.step()
    llm.abort("a")
    assert not llm._prompt_pending and not llm._processing_ids
    llm.drain()
    assert_no_leak(llm)
