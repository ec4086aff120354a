"""Scheduler bookkeeping against the real KV-cache manager, no model: budgets, chunking,
preemption, priority, stop conditions, rejection and abort."""

from __future__ import annotations

import pytest

from pagedcore.engine.sampling.sampling_params import SamplingParams
from pagedcore.engine.scheduling.request import Request, RequestStatus
from pagedcore.engine.scheduling.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pagedcore.kv_cache.manager import KVCacheManager
from pagedcore.kv_cache.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

BLOCK = 4


def make_scheduler(num_blocks: int = 64, lookahead_blocks: int = 0,
                   **config: object) -> Scheduler:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype="float32")
    kv_config = KVCacheConfig(
        num_blocks=num_blocks,
        groups=(KVCacheGroupSpec(layer_names=("model.layers.0.self_attn",), spec=spec),),
    )
    cfg = SchedulerConfig(**{"max_model_len": 64, **config})  # type: ignore[arg-type]
    manager = KVCacheManager(kv_config, cfg.max_model_len, enable_caching=True)
    return Scheduler(cfg, manager, kv_config, lookahead_blocks=lookahead_blocks)


_arrivals = iter(range(10**6))


def req(rid: str, prompt: list[int] | int, **params: object) -> Request:
    """A request; an int prompt gets tokens no other request shares (no prefix hits)."""
    arrival = next(_arrivals)
    base = 1000 * (arrival + 1)
    tokens = list(range(base, base + prompt)) if isinstance(prompt, int) else prompt
    return Request(rid, tokens, SamplingParams(temperature=0.0, **params),  # type: ignore[arg-type]
                   arrival_index=arrival, eos_token_ids=(2,))


def run_step(s: Scheduler, token: int = 7) -> SchedulerOutput:
    out = s.schedule()
    sampled = {x.request.request_id: (token, None) for x in out.scheduled if x.samples}
    s.update_from_output(out, sampled, now=0.0)
    return out


def run_all(s: Scheduler, limit: int = 500) -> list[SchedulerOutput]:
    steps = []
    while s.has_unfinished_requests():
        steps.append(run_step(s))
        assert len(steps) < limit, "scheduler made no progress"
    return steps


def assert_clean(s: Scheduler) -> None:
    kv = s.kv
    assert isinstance(kv, KVCacheManager)
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_total_blocks


def test_token_budget_and_running_first() -> None:
    s = make_scheduler(max_num_batched_tokens=8)
    reqs = [req(f"r{i}", 10, max_tokens=3) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    first = run_step(s)
    assert [(x.request.request_id, x.start, x.num_new_tokens) for x in first.scheduled] == [
        ("r0", 0, 8)
    ]
    second = run_step(s)
    # r0 (running) finishes its prompt first, r1 takes the rest of the budget.
    assert [(x.request.request_id, x.start, x.num_new_tokens) for x in second.scheduled] == [
        ("r0", 8, 2), ("r1", 0, 6)
    ]
    assert second.scheduled[0].samples and not second.scheduled[1].samples
    steps = run_all(s)
    assert all(step.num_scheduled_tokens <= 8 for step in steps)
    assert all(r.output_token_ids == [7, 7, 7] for r in reqs)
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)
    assert_clean(s)


def test_long_prefill_threshold_and_max_num_seqs() -> None:
    s = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=5,
                       max_num_seqs=2)
    for i in range(3):
        s.add_request(req(f"r{i}", 12, max_tokens=2))
    out = run_step(s)
    assert [x.num_new_tokens for x in out.scheduled] == [5, 5]
    assert len(s.running) == 2 and len(s.waiting) == 1
    run_all(s)
    assert_clean(s)


def test_no_chunking_waits_for_whole_prompt() -> None:
    s = make_scheduler(max_num_batched_tokens=64, enable_chunked_prefill=False)
    s.add_request(req("a", 40, max_tokens=2))
    s.add_request(req("b", 30, max_tokens=2))
    out = run_step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 40)]
    run_all(s)
    assert_clean(s)


def test_preemption_recomputes_newest_and_keeps_tokens() -> None:
    # 10 usable blocks of 4 tokens; three requests growing to 24 tokens each cannot coexist.
    s = make_scheduler(num_blocks=11, max_num_batched_tokens=64, max_model_len=32)
    reqs = [req(f"r{i}", [i * 50 + j for j in range(8)], max_tokens=16) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    preempted: list[str] = []
    while s.has_unfinished_requests():
        out = run_step(s)
        preempted += [r.request_id for r in out.preempted]
        s.kv.check_invariants()  # type: ignore[attr-defined]
    assert preempted and preempted[0] == "r2", preempted  # the newest goes first
    assert all(r.num_output_tokens == 16 for r in reqs)
    assert reqs[2].metrics.num_preemptions >= 1
    assert s.stats.num_preemptions == len(preempted)
    assert_clean(s)


def test_priority_policy_orders_admission_and_preemption() -> None:
    s = make_scheduler(num_blocks=11, max_num_batched_tokens=64, max_model_len=32,
                       policy="priority", max_num_seqs=1)
    s.add_request(req("low", 4, max_tokens=1, priority=5))
    s.add_request(req("high", 4, max_tokens=1, priority=-1))
    out = run_step(s)
    assert [x.request.request_id for x in out.scheduled] == ["high"]
    run_all(s)

    s = make_scheduler(num_blocks=11, max_num_batched_tokens=64, max_model_len=32,
                       policy="priority")
    a = req("a", [1] * 8, max_tokens=16, priority=9)
    b = req("b", [3] * 8, max_tokens=16, priority=0)
    c = req("c", [5] * 8, max_tokens=16, priority=1)
    for r in (a, b, c):
        s.add_request(r)
    preempted: list[str] = []
    while s.has_unfinished_requests():
        preempted += [r.request_id for r in run_step(s).preempted]
    assert preempted[0] == "a"  # lowest priority (largest value) first, though oldest
    assert_clean(s)


def test_stop_conditions() -> None:
    s = make_scheduler()
    eos = req("eos", 3, max_tokens=10)
    ignore = req("ignore", 3, max_tokens=4, ignore_eos=True)
    stop = req("stop", 3, max_tokens=10, stop_token_ids=[2])
    for r in (eos, ignore, stop):
        s.add_request(r)
    out = s.schedule()
    s.update_from_output(out, {r: (2, None) for r in ("eos", "ignore", "stop")}, now=0.0)
    assert eos.status is RequestStatus.FINISHED_STOPPED and eos.output_token_ids == [2]
    assert stop.status is RequestStatus.FINISHED_STOPPED
    assert ignore.status is RequestStatus.RUNNING
    run_all(s)
    assert ignore.num_output_tokens == 4 and ignore.finish_reason == "length"

    s = make_scheduler(max_model_len=16)
    long = req("long", 10, max_tokens=100)
    s.add_request(long)
    run_all(s)
    assert long.num_tokens == 16 and long.status is RequestStatus.FINISHED_LENGTH
    assert_clean(s)


def test_rejections_are_clear_and_leave_nothing_queued() -> None:
    s = make_scheduler(num_blocks=5, max_model_len=64)
    with pytest.raises(ValueError, match=r"70 tokens.*max_model_len=64"):
        s.add_request(req("big", 70))
    with pytest.raises(ValueError, match="empty"):
        s.add_request(req("empty", []))
    # 4 usable blocks = 16 tokens; 10 + 8 - 1 = 17 tokens need 5 blocks.
    with pytest.raises(ValueError, match=r"needs 5 KV blocks but the cache has only 4"):
        s.add_request(req("fat", 10, max_tokens=8))
    assert not s.has_unfinished_requests()
    ok = req("ok", 10, max_tokens=7)
    s.add_request(ok)
    with pytest.raises(ValueError, match="already in the engine"):
        s.add_request(req("ok", 3))
    run_all(s)
    assert ok.num_output_tokens == 7
    assert_clean(s)


def test_abort_frees_blocks_and_unknown_id_is_an_error() -> None:
    s = make_scheduler()
    a, b = req("a", 9, max_tokens=50), req("b", 9, max_tokens=3)
    s.add_request(a)
    s.add_request(b)
    run_step(s)
    assert s.kv.usage > 0
    [aborted] = s.abort("a", now=1.0)
    assert aborted.status is RequestStatus.FINISHED_ABORTED and aborted.finish_reason == "abort"
    with pytest.raises(KeyError, match="unknown or already finished"):
        s.abort("a", now=1.0)
    with pytest.raises(KeyError, match="nope"):
        s.abort(["nope"], now=1.0)
    run_all(s)
    assert b.num_output_tokens == 3
    assert_clean(s)


def test_prefix_hits_recorded_once() -> None:
    s = make_scheduler()
    shared = list(range(200, 213))  # 13 tokens: three full blocks
    first = req("first", shared, max_tokens=1)
    s.add_request(first)
    run_all(s)
    second = req("second", [*shared, 5], max_tokens=2)
    s.add_request(second)
    run_all(s)
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 12
    assert s.stats.prefix_hit_tokens == 12 and s.stats.prompt_tokens == 27
    assert_clean(s)


def test_priority_preempts_an_already_scheduled_request() -> None:
    # "low" is admitted first, so it is scheduled before "high" in every step; when "high"
    # needs a block and none is free, "low" (already scheduled this step) is the victim: its
    # share of the budget is refunded and "high" still runs in the same step.
    s = make_scheduler(num_blocks=8, max_num_batched_tokens=64, max_model_len=28,
                       policy="priority")
    low = req("low", [1] * 8, max_tokens=12, priority=9)
    s.add_request(low)
    run_step(s)
    high = req("high", [3] * 7, max_tokens=12, priority=0)
    s.add_request(high)
    seen = False
    while s.has_unfinished_requests():
        out = run_step(s)
        ids = [x.request.request_id for x in out.scheduled]
        if "low" in [r.request_id for r in out.preempted] and "high" in ids:
            seen = True
            assert "low" not in ids
            assert out.num_scheduled_tokens <= 64
        s.kv.check_invariants()  # type: ignore[attr-defined]
    assert seen
    assert low.num_output_tokens == 12 and high.num_output_tokens == 12
    assert_clean(s)
