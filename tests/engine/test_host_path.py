"""The host-side fast paths of a decode step: few KV-manager calls, same outputs."""

from __future__ import annotations

from typing import Any

from engine_helpers import assert_no_leak, make_models, random_prompts

from pagedcore import LLM, SamplingParams


def test_decodes_reserve_blocks_ahead_and_still_cache_them() -> None:
    """The prompt's allocation and a decode running past its blocks reserve several more, so
    a request decoding 100 tokens calls allocate_slots twice (prefill, one reservation)
    instead of once per block; the blocks it completes meanwhile still reach the prefix cache
    when it finishes (a follow-up prompt repeating prompt + output hits every full block)."""
    _config, _ref, eng = make_models("llama")
    llm = LLM(eng, device="cpu", block_size=16, max_model_len=160, kv_cache_memory_bytes=1 << 20)
    kv = llm.kv_cache_manager
    real = kv.allocate_slots
    calls: list[tuple[int, int]] = []

    def counting(request: Any, num_new: int, **kwargs: Any) -> Any:
        calls.append((num_new, kwargs.get("num_lookahead_tokens", 0)))
        return real(request, num_new, **kwargs)

    kv.allocate_slots = counting  # type: ignore[method-assign]
    prompt = random_prompts([10])[0]
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    out = llm.generate([prompt], params)
    generated = out[0].outputs[0].token_ids
    assert len(generated) == 100
    # Prefill with 64 lookahead slots (5 blocks: 80 tokens), one reservation at position 80
    # (blocks up to 160 tokens), and the registration of the written blocks at the finish.
    assert calls == [(10, 64), (1, 64), (0, 0)], calls
    follow = llm.generate([prompt + generated], SamplingParams(max_tokens=1, temperature=0.0))
    # 109 tokens were written (the last output token never is): 6 full blocks of 16.
    assert follow[0].num_cached_tokens == 96
    assert_no_leak(llm)


def test_no_lookahead_when_the_cache_is_full() -> None:
    """Decodes reserve blocks ahead only while the cache is less than LOOKAHEAD_MAX_USAGE
    full (else they allocate exactly, not to crowd other requests out); outputs under a tight
    cache equal those of a roomy one."""
    import torch

    from pagedcore.engine.scheduling.request_blocks import LOOKAHEAD_MAX_USAGE
    from pagedcore.kv_cache.config import kv_cache_specs_from_hf_config

    config, _ref, eng = make_models("llama")
    _config, _ref, eng2 = make_models("llama")
    specs = kv_cache_specs_from_hf_config(config, block_size=4, dtype=torch.float32)
    page = next(iter(specs.values())).page_size_bytes * len(specs)
    kw: dict[str, Any] = dict(device="cpu", block_size=4, max_model_len=32,
                              max_num_batched_tokens=32)
    tight = LLM(eng, kv_cache_memory_bytes=13 * page, **kw)  # 12 usable blocks
    roomy = LLM(eng2, kv_cache_memory_bytes=256 * page, **kw)
    kv = tight.kv_cache_manager
    real = kv.allocate_slots
    decode_calls: list[tuple[float, int, bool]] = []

    def recording(request: Any, num_new: int, **kwargs: Any) -> Any:
        usage = kv.usage
        got = real(request, num_new, **kwargs)
        if num_new == 1:
            decode_calls.append((usage, kwargs.get("num_lookahead_tokens", 0), got is not None))
        return got

    kv.allocate_slots = recording  # type: ignore[method-assign]
    prompts = random_prompts([5, 6, 3, 9])
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    assert got == expected
    assert all(u < LOOKAHEAD_MAX_USAGE for u, ahead, _ in decode_calls if ahead), decode_calls
    assert any(ahead for _, ahead, ok in decode_calls if ok), decode_calls
    assert any(not ahead and u >= LOOKAHEAD_MAX_USAGE for u, ahead, _ in decode_calls)
    assert_no_leak(tight)


def test_scheduler_counts_step_tokens_exactly() -> None:
    """`SchedulerOutput.total_tokens` (the budget spent, used instead of a per-step sum)
    equals the scheduled tokens, and the block ids the scheduler keeps (appended to, not
    re-read, on a decode's new block) equal the KV manager's, through chunked prefills,
    prefix hits, admissions and preemptions."""
    _config, _ref, eng = make_models("qwen2")
    llm = LLM(eng, device="cpu", block_size=4, max_model_len=64, max_num_batched_tokens=24,
              long_prefill_token_threshold=10, kv_cache_memory_bytes=1 << 16)
    real = llm.scheduler.schedule
    seen: list[tuple[int | None, int]] = []

    def checked() -> Any:
        out = real()
        seen.append((out.total_tokens, sum(s.num_new_tokens for s in out.scheduled)))
        # The scheduler's incrementally kept block ids are the manager's.
        for item in out.scheduled:
            rid = item.request.request_id
            assert llm.scheduler.block_ids(rid) == llm.kv_cache_manager.get_block_ids(rid)
        return out

    llm.scheduler.schedule = checked  # type: ignore[method-assign]
    shared = random_prompts([9], seed=4)[0]
    llm.generate([shared + p for p in random_prompts([30, 7, 19, 3, 25])],
                 SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert llm.stats()["preemptions"] > 0
    assert len(seen) > 10 and all(a == b for a, b in seen), seen


def test_step_finished_only_returns_finished_outputs() -> None:
    _config, _ref, eng = make_models("qwen2")
    llm = LLM(eng, device="cpu", max_model_len=64)
    prompts = random_prompts([4, 6])
    for i, (prompt, n) in enumerate(zip(prompts, (3, 6), strict=True)):
        llm.add_request(f"r{i}", prompt, SamplingParams(max_tokens=n, temperature=0.0))
    seen: list[list[str]] = []
    while llm.has_unfinished_requests():
        outs = llm.step(finished_only=True)
        assert all(o.finished for o in outs)
        seen.append([o.request_id for o in outs])
    assert seen == [[], [], ["r0"], [], [], ["r1"]]
    assert_no_leak(llm)


def test_plain_outputs_equal_the_classes_own_construction() -> None:
    """`plain_outputs` sets the output objects' fields directly (no class call): every field
    the classes have, the values their constructors would hold; the others left to
    `build_output`."""
    import attrs

    from pagedcore.engine import output_builder as ob
    from pagedcore.engine.outputs import CompletionOutput, RequestOutput
    from pagedcore.engine.scheduling.request import Request, RequestStatus

    assert ob._COMPLETION_FIELDS == tuple(f.name for f in attrs.fields(CompletionOutput))
    assert ob._REQUEST_OUTPUT_FIELDS == tuple(f.name for f in attrs.fields(RequestOutput))
    parents = []
    for i, status in enumerate((RequestStatus.RUNNING, RequestStatus.FINISHED_STOPPED,
                                RequestStatus.FINISHED_LENGTH)):
        params = SamplingParams(max_tokens=8, logprobs=1 if i == 2 else None)
        parent = ob.ParentRequest(f"r{i}", "text" if i else None, [3, 4, 5],
                                  sampling_defaults={"top_k": 5} if i == 1 else None)
        child = Request(f"r{i}", [3, 4, 5], params, arrival_index=i)
        child.append_token(9)
        child.status, child.stop_reason, child.num_cached_tokens = status, 9, 2 * i
        parent.children.append(child)
        parents.append(parent)
    outputs, others, finished = ob.plain_outputs(parents, errors={})
    assert others == [2] and outputs[2] is None  # logprobs: not plain
    assert finished == [parents[1]]
    for parent, out in zip(parents[:2], outputs[:2], strict=True):
        child = parent.children[0]
        reason = child.finish_reason
        expected = RequestOutput(
            request_id=parent.request_id, prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=[CompletionOutput(index=0, token_ids=[9],
                                      finish_reason=None if reason is None else reason.value,
                                      stop_reason=None if reason is None else 9)],
            finished=reason is not None, num_cached_tokens=child.num_cached_tokens,
            metrics=child.metrics, sampling_defaults=dict(parent.sampling_defaults))
        assert out == expected
        assert out is not None and out.sampling_defaults is not parent.sampling_defaults
        assert out.outputs[0].token_ids is not child.all_token_ids
        assert out == ob.build_output(parent, tokenizer=None, errors={})
