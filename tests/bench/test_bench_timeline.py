"""The arrival-timeline driver and the chunked-prefill arithmetic, on a virtual clock.

With `VirtualClock(per_token=1)` a step costs exactly the tokens it computed, so every time below
is derived by hand from the scheduler's rules (running requests first, a per-request prefill cap
of `long_prefill_token_threshold`, no chunking without `enable_chunked_prefill`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from pagedcore.bench.chunked import make_timeline, summarize
from pagedcore.bench.timeline import Arrival, Trace, VirtualClock, run_timeline
from pagedcore.engine.sampling.sampling_params import SamplingParams

LONG, SHORT = 256, 20


def _workload(short_at: float = 10.0) -> list[Arrival]:
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    return [
        Arrival(request_id="long", at=0.0, prompt=[5 + i % 100 for i in range(LONG)], params=one),
        Arrival(request_id="short", at=short_at, prompt=[7] * SHORT, params=one),
    ]


def test_no_chunking_short_waits_for_the_whole_long_prefill(make_llm: Callable[..., Any]) -> None:
    llm = make_llm(enable_chunked_prefill=False, max_num_batched_tokens=512,
                   enable_prefix_caching=False)
    (long, short), steps = run_timeline(llm, _workload(), clock=VirtualClock(per_token=1.0))
    # Step 1 computes the whole long prompt [0, 256]; the short joins after it, alone.
    assert [s.num_tokens for s in steps] == [LONG, SHORT]
    assert long.ttft == LONG and long.latency == LONG
    assert short.ttft == LONG + SHORT - 10.0
    assert long.num_cached_tokens == 0 and short.num_cached_tokens == 0


def test_threshold_lets_the_short_request_in_during_the_long_prefill(
    make_llm: Callable[..., Any],
) -> None:
    llm = make_llm(enable_chunked_prefill=True, max_num_batched_tokens=512,
                   long_prefill_token_threshold=64, enable_prefix_caching=False)
    (long, short), steps = run_timeline(llm, _workload(), clock=VirtualClock(per_token=1.0))
    # 64 | 64 + 20 (the short rides along) | 64 | 64 -> the long finishes at 256 + 20.
    assert [s.num_tokens for s in steps] == [64, 64 + SHORT, 64, 64]
    assert short.ttft == 64 + 64 + SHORT - 10.0
    assert long.latency == LONG + SHORT
    assert steps[1].start == 64 and steps[1].end == 64 + 64 + SHORT


def test_budget_alone_does_not_help_a_short_request_behind_a_running_prefill(
    make_llm: Callable[..., Any],
) -> None:
    llm = make_llm(enable_chunked_prefill=True, max_num_batched_tokens=64,
                   enable_prefix_caching=False)
    (_, short), steps = run_timeline(llm, _workload(), clock=VirtualClock(per_token=1.0))
    # The running long request takes the whole 64-token budget each step: the short waits.
    assert [s.num_tokens for s in steps] == [64, 64, 64, 64, SHORT]
    assert short.ttft == LONG + SHORT - 10.0


def test_idle_engine_sleeps_until_the_next_arrival(make_llm: Callable[..., Any]) -> None:
    llm = make_llm(enable_prefix_caching=False)
    clock = VirtualClock(fixed=1.0, per_token=0.0)
    traces, steps = run_timeline(llm, _workload(short_at=100.0), clock=clock)
    assert steps[-1].start == 100.0
    assert traces[1].ttft == 1.0  # one fixed-cost step after its arrival


def test_driver_rejects_duplicate_ids_and_busy_engines(make_llm: Callable[..., Any]) -> None:
    llm = make_llm()
    work = _workload()
    with pytest.raises(ValueError, match="unique"):
        run_timeline(llm, [work[0], work[0]], clock=VirtualClock())
    llm.add_request("busy", [3] * 8, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="idle engine"):
        run_timeline(llm, work, clock=VirtualClock())


def test_make_timeline_is_fixed_and_inside_the_window() -> None:
    a = make_timeline(long_len=100, num_short=20, short_lens=(5, 9), short_max_tokens=3,
                      long_max_tokens=2, window_s=2.0, vocab=64, seed=3)
    b = make_timeline(long_len=100, num_short=20, short_lens=(5, 9), short_max_tokens=3,
                      long_max_tokens=2, window_s=2.0, vocab=64, seed=3)
    assert [x.prompt for x in a] == [x.prompt for x in b]
    times = [x.at for x in a]
    assert times[0] == 0.0 and len(times) == 21
    assert times[1] == pytest.approx(0.5 / 20 * 0.9 * 2.0)
    assert times[-1] == pytest.approx(19.5 / 20 * 0.9 * 2.0) and times[-1] < 2.0
    assert all(5 <= len(x.prompt) <= 9 for x in a[1:]) and len(a[0].prompt) == 100


def test_summarize_pools_shorts_and_takes_the_long_median() -> None:
    def run(long_end: float, short_times: list[list[float]]) -> list[Trace]:
        traces = [Trace(request_id="long", arrival=0.0, num_prompt_tokens=9,
                        token_times=[long_end], finished=long_end)]
        for i, times in enumerate(short_times):
            traces.append(Trace(request_id=f"s{i}", arrival=1.0, num_prompt_tokens=2,
                                token_times=times, finished=times[-1]))
        return traces

    out = summarize([run(10.0, [[2.0, 2.5, 4.5]]), run(30.0, [[3.0, 3.5]]),
                     run(20.0, [[5.0, 6.0]])])
    # TTFTs 1, 2, 4; ITLs 0.5, 2.0, 0.5, 1.0.
    assert out["short_ttft_s"]["p50"] == 2.0 and out["short_ttft_s"]["n"] == 3
    assert out["short_itl_s"]["n"] == 4
    assert out["short_itl_s"]["p50"] == pytest.approx(0.75)
    assert out["long_completion_s"] == 20.0 and out["unfinished"] == 0


class _FakeEngine:
    """Reports a fixed token count per step; its scheduler has no `schedule` to wrap."""

    def __init__(self, tokens_per_step: int, steps_per_request: int) -> None:
        self.tokens_per_step = tokens_per_step
        self.steps_per_request = steps_per_request
        self.left: dict[str, int] = {}
        self.last_step_num_scheduled_tokens = 0
        self.scheduler = type("Sched", (), {"running": []})()

    def has_unfinished_requests(self) -> bool:
        return bool(self.left)

    def add_request(self, request_id: str, prompt: list[int], params: Any) -> None:
        self.left[request_id] = self.steps_per_request

    def step(self) -> list[Any]:
        self.last_step_num_scheduled_tokens = self.tokens_per_step
        outs = []
        for rid in list(self.left):
            self.left[rid] -= 1
            done = self.left[rid] == 0
            produced = self.steps_per_request - self.left[rid]
            outs.append(type("Out", (), {
                "request_id": rid, "finished": done, "num_cached_tokens": 0, "error": None,
                "outputs": [type("C", (), {"token_ids": [1] * produced})()],
            })())
            if done:
                del self.left[rid]
        return outs


def test_driver_charges_the_engines_reported_step_tokens() -> None:
    fake = _FakeEngine(tokens_per_step=7, steps_per_request=3)
    (trace,), steps = run_timeline(fake, _workload()[:1], clock=VirtualClock(per_token=1.0))
    assert [s.num_tokens for s in steps] == [7, 7, 7]
    assert trace.token_times == [7.0, 14.0, 21.0]


def test_driver_leaves_the_scheduler_alone(make_llm: Callable[..., Any]) -> None:
    llm = make_llm(enable_prefix_caching=False)
    _, steps = run_timeline(llm, _workload(), clock=VirtualClock(per_token=1.0))
    assert "schedule" not in vars(llm.scheduler)
    assert sum(s.num_tokens for s in steps) == LONG + SHORT
