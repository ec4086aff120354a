"""The all-decode fast path (`Scheduler._schedule_decodes`, `DecodeBatch`) and the padded
decode input path (one upload of the per-step buffers, changed block-table rows only): same
steps, slots and outputs as the general paths, and nothing written on the host is left behind
on the device (checked on the CPU with mirrored device buffers)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_helpers import assert_no_leak, make_models, random_prompts
from graph_backend import graph_backend_registered

from pagedcore import LLM, SamplingParams
from pagedcore.engine.runner.cuda_graph import EagerCapturer
from pagedcore.engine.runner.input_batch import InputBatch
from pagedcore.engine.scheduling.request import Request
from pagedcore.engine.scheduling.scheduler_types import DecodeBatch, ScheduledRequest

Step = list[tuple[str, int, int, bool]]


def _recording(llm: LLM) -> tuple[list[Step], list[list[list[int]]], list[bool]]:
    """Record each step's (id, start, tokens, samples), its slot mappings, and whether the
    scheduler took the all-decode fast path."""
    steps: list[Step] = []
    slots: list[list[list[int]]] = []
    fast: list[bool] = []
    schedule, prepare = llm.scheduler.schedule, llm.runner.prepare

    def rec_schedule() -> Any:
        out = schedule()
        fast.append(isinstance(out.scheduled, DecodeBatch))
        steps.append([(s.request.request_id, s.start, s.num_new_tokens, s.samples)
                      for s in out.scheduled])
        return out

    def rec_prepare(*args: Any, **kwargs: Any) -> Any:
        inputs = prepare(*args, **kwargs)
        n = inputs.num_tokens
        slots.append([c.slot_mapping[:n].tolist() for c in inputs.common])
        return inputs

    llm.scheduler.schedule = rec_schedule  # type: ignore[method-assign]
    llm.runner.prepare = rec_prepare  # type: ignore[method-assign]
    return steps, slots, fast


def test_fast_path_schedules_what_the_general_loop_does() -> None:
    """Block size 4 (decodes cross block boundaries, allocating with and without lookahead),
    a KV budget that forces preemption, requests finishing at different steps and waiting
    ones admitted into freed room: step by step the fast path schedules the same tokens
    and slots as the general loop, outputs are identical, and no block leaks."""
    engines = []
    for _ in range(2):
        _config, _ref, eng = make_models("qwen2")
        engines.append(LLM(eng, device="cpu", block_size=4, max_model_len=64, max_num_seqs=6,
                           max_num_batched_tokens=32, kv_cache_memory_bytes=20 * 2048))
    fast, general = engines
    general.scheduler._schedule_decodes = lambda budget: None  # type: ignore[method-assign]
    rec_fast, rec_general = _recording(fast), _recording(general)
    # Count the allocations made inside the fast path (decodes running past their blocks).
    kv, real_allocate = fast.kv_cache_manager, fast.kv_cache_manager.allocate_slots
    real_decodes = fast.scheduler._schedule_decodes
    calls, in_fast = [0], [0]

    def allocate(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real_allocate(*args, **kwargs)

    def decodes(budget: int) -> Any:
        before = calls[0]
        out = real_decodes(budget)
        in_fast[0] += calls[0] - before
        return out

    kv.allocate_slots = allocate  # type: ignore[method-assign]
    fast.scheduler._schedule_decodes = decodes  # type: ignore[method-assign]
    prompts = random_prompts([5, 9, 3, 14, 7, 11, 4, 8])
    params = [SamplingParams(max_tokens=6 + 3 * (i % 4), temperature=0.0, ignore_eos=True,
                             logprobs=2) for i in range(len(prompts))]
    out_fast = fast.generate(prompts, params)
    out_general = general.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in out_fast] == [
        o.outputs[0].token_ids for o in out_general]
    assert rec_fast[0] == rec_general[0]  # scheduled tokens, step by step
    assert rec_fast[1] == rec_general[1]  # slot mappings, step by step
    assert sum(rec_fast[2]) >= 10 and not any(rec_general[2])
    assert fast.stats()["preemptions"] > 0
    assert fast.stats()["preemptions"] == general.stats()["preemptions"]
    # Decodes crossed block boundaries inside the fast path (a start that is a multiple of 4).
    crossed = [s for step, f in zip(rec_fast[0], rec_fast[2], strict=True) if f
               for s in step if s[1] % 4 == 0]
    assert crossed and in_fast[0] > 0
    for llm in engines:
        assert_no_leak(llm)


def test_decode_batch_items() -> None:
    reqs = [Request(f"r{i}", [1, 2, 3, 4][: i + 2], SamplingParams(), arrival_index=i)
            for i in range(3)]
    batch = DecodeBatch(reqs, [1, 2, 3])
    assert len(batch) == 3 and repr(batch) == "DecodeBatch(3 requests)"
    items = list(batch)
    assert [(s.request.request_id, s.start, s.num_new_tokens, s.samples) for s in items] == [
        ("r0", 1, 1, True), ("r1", 2, 1, True), ("r2", 3, 1, True)]
    assert batch[1] is items[1] and batch[1:] == items[1:]
    with pytest.raises(ValueError, match="2 requests but 3 starts"):
        DecodeBatch(reqs[:2], [1, 2, 3])


def _decode(request_id: str, tokens: list[int]) -> ScheduledRequest:
    req = Request(request_id, tokens, SamplingParams(max_tokens=4), arrival_index=0)
    return ScheduledRequest(req, len(tokens) - 1, 1, samples=True)


def test_padded_decode_uploads_what_it_writes() -> None:
    """With device buffers of their own (mirror), each padded step's device block tables,
    slots, positions and ids are exactly the step's: changed rows, a shrinking batch (stale
    rows back to the null block), two groups."""
    batch = InputBatch(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=40,
                       block_sizes=[4, 8], device=torch.device("cpu"), mirror=True)
    assert batch._ids.device.data_ptr() != batch._ids.host.data_ptr()
    blocks: dict[str, tuple[list[int], ...]] = {
        "a": ([3, 4, 5], [7, 2]), "b": ([6], [9]), "c": ([8, 1], [11])}
    step = [_decode("a", list(range(10, 20))), _decode("b", [5, 6, 7]),
            _decode("c", [1, 2, 3, 4, 5, 6])]
    for bucket in (4, 8):
        inputs = batch.prepare(step, blocks.__getitem__, pad_to=bucket)
        common = inputs.common
        assert common[0].block_table[:3].tolist() == [[3, 4, 5] + [0] * 7, [6] + [0] * 9,
                                                       [8, 1] + [0] * 8]
        assert common[1].block_table[:3, :2].tolist() == [[7, 2], [9, 0], [11, 0]]
        assert inputs.input_ids.tolist() == [19, 7, 6] + [0] * (bucket - 3)
        assert common[0].slot_mapping.tolist() == [21, 26, 5] + [-1] * (bucket - 3)
        assert common[1].slot_mapping.tolist() == [17, 74, 93] + [-1] * (bucket - 3)
    # b moves on to a new block (a new tuple), c leaves: row 1 rewritten, row 2 back to 0.
    blocks["b"] = ([6, 12], [9])
    b = Request("b", [5, 6, 7, 8, 9], SamplingParams(max_tokens=4), arrival_index=0)
    step2 = DecodeBatch([step[0].request, b], [9, 4])
    inputs = batch.prepare(step2, blocks.__getitem__, pad_to=4)
    table = inputs.common[0].block_table
    assert table[:3].tolist() == [[3, 4, 5] + [0] * 7, [6, 12] + [0] * 8, [0] * 10]
    assert inputs.common[0].slot_mapping.tolist() == [21, 48, -1, -1]
    assert inputs.positions.tolist() == [9, 4, 0, 0]
    assert inputs.common[0].seq_lens.tolist() == [10, 5, 1, 1]
    assert inputs.logits_indices.tolist() == [0, 1]
    assert inputs.sample_rows is step2


def test_padded_decodes_with_mirrored_buffers_match_eager() -> None:
    """Graph steps (EagerCapturer replays over the device-side buffers, which the host writes
    reach only by upload) through the all-decode fast path and its hints equal eager steps
    of the general path token for token, through block boundaries, a shrinking and a
    growing batch."""
    with graph_backend_registered() as name:
        common: dict[str, Any] = dict(device="cpu", backend=name, block_size=4,
                                      max_model_len=64, max_num_seqs=8,
                                      max_num_batched_tokens=64,
                                      kv_cache_memory_bytes=1 << 21)
        _config, _ref, eng = make_models("qwen2")
        eager = LLM(eng, enforce_eager=True, **common)
        # The reference takes the general scheduling and input path (no DecodeBatch, no hints).
        eager.scheduler._schedule_decodes = lambda budget: None  # type: ignore[method-assign]
        _config, _ref, eng2 = make_models("qwen2")
        graphs = LLM(eng2, **common)
        old = graphs.runner.input_batch
        graphs.runner.input_batch = InputBatch(
            max_num_seqs=old._max_num_seqs, max_num_batched_tokens=old._max_num_tokens,
            max_model_len=old.max_model_len, block_sizes=old.block_sizes, device=old.device,
            decode_threshold=old.decode_threshold, mirror=True)
        capturer = EagerCapturer()
        graphs.runner.enable_cudagraphs(capturer=capturer, sizes=[1, 2, 4, 8])
        _steps, _slots, fast = _recording(graphs)
        # How often the engine's hints let input preparation skip reading requests: the
        # previous step's sampled tokens as input ids, and a full block-table check skipped.
        batch = graphs.runner.input_batch
        hints, full_checks = [], [0]
        real_prepare, real_fill = batch.prepare, batch._fill_tables

        def prepare(scheduled: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(scheduled, DecodeBatch):
                hints.append(scheduled.token_ids is not None)
            return real_prepare(scheduled, *args, **kwargs)

        def fill(*args: Any, **kwargs: Any) -> Any:
            full_checks[0] += 1
            return real_fill(*args, **kwargs)

        batch.prepare = prepare  # type: ignore[method-assign]
        batch._fill_tables = fill  # type: ignore[method-assign]
        prompts = random_prompts([5, 9, 13, 3, 21, 30, 7])
        params = [SamplingParams(max_tokens=3 + 2 * i, temperature=0.0, ignore_eos=True,
                                 logprobs=2) for i in range(len(prompts))]
        more = random_prompts([4, 6, 2], seed=3)
        p3 = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, logprobs=2)
        expected = eager.generate(prompts, params) + eager.generate(more, p3)
        got = graphs.generate(prompts, params) + graphs.generate(more, p3)
        for a, b in zip(expected, got, strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            lp_a, lp_b = a.outputs[0].logprobs, b.outputs[0].logprobs
            assert lp_a is not None and lp_b is not None
            for ea, eb in zip(lp_a, lp_b, strict=True):
                assert ea.keys() == eb.keys()
                assert all(abs(ea[t] - eb[t]) < 1e-5 for t in ea)
        assert capturer.num_replays >= 14 and sum(fast) >= 14
        assert sum(hints) >= 10 and full_checks[0] <= len(_steps) - 10
        assert_no_leak(graphs)
        assert_no_leak(eager)


def test_eager_decode_batch_inputs_equal_the_general_path() -> None:
    """An eager (unpadded) step given as a `DecodeBatch` yields the same tensors and
    metadata as the same step given as `ScheduledRequest`s (two groups)."""
    kw: dict[str, Any] = dict(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=40,
                              block_sizes=[4, 8], device=torch.device("cpu"))
    blocks = {"a": ([3, 4, 5], [7, 2]), "b": ([6], [9]), "c": ([8, 1], [11])}
    step = [_decode("a", list(range(10, 20))), _decode("b", [5, 6, 7]),
            _decode("c", [1, 2, 3, 4, 5, 6])]
    want = InputBatch(**kw).prepare(step, blocks.__getitem__)
    batch = DecodeBatch([s.request for s in step], [s.start for s in step])
    got = InputBatch(**kw).prepare(batch, blocks.__getitem__)
    assert got.sample_rows is batch and got.order is batch and got.cudagraph_bucket is None
    assert got.input_ids.tolist() == want.input_ids.tolist() == [19, 7, 6]
    assert got.positions.tolist() == want.positions.tolist()
    assert got.logits_indices.tolist() == want.logits_indices.tolist() == [0, 1, 2]
    for a, b in zip(got.common, want.common, strict=True):
        for field in ("query_start_loc", "query_start_loc_cpu", "seq_lens", "seq_lens_cpu",
                      "block_table", "slot_mapping"):
            assert torch.equal(getattr(a, field), getattr(b, field)), field
        for field in ("num_reqs", "num_actual_tokens", "max_query_len", "max_seq_len"):
            assert getattr(a, field) == getattr(b, field), field
