"""The chunked-prefill experiment's engine reuse and per-configuration figures, on a virtual
clock (a step costs exactly the tokens it computed, so every figure is derived by hand)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from pagedcore.bench.chunked import apply_config, run_config
from pagedcore.bench.timeline import Arrival, VirtualClock
from pagedcore.engine.sampling.sampling_params import SamplingParams

LONG, SHORT = 256, 20


def _arrivals() -> list[Arrival]:
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    return [
        Arrival(request_id="long", at=0.0, prompt=[5 + i % 100 for i in range(LONG)], params=one),
        Arrival(request_id="short", at=10.0, prompt=[7] * SHORT, params=one),
    ]


def _clock() -> VirtualClock:
    return VirtualClock(per_token=1.0)


def test_one_engine_serves_every_configuration_as_a_fresh_one_would(
    make_llm: Callable[..., Any],
) -> None:
    llm = make_llm(max_num_batched_tokens=512, enable_prefix_caching=False)
    # No chunking: the long prompt is one step of 256 tokens, never split by the budget; the
    # short arrived during it and waits for it.
    apply_config(llm, dict(enable_chunked_prefill=False, max_num_batched_tokens=512,
                           long_prefill_token_threshold=None))
    base = run_config(llm, _arrivals(), reps=2, clock_factory=_clock)
    assert base["long_prefill_steps_last_rep"] == 1
    assert base["max_step_tokens_last_rep"] == LONG
    assert base["shorts_arriving_during_long_prefill_last_rep"] == 1
    assert base["short_ttft_s"]["p50"] == LONG + SHORT - 10.0
    assert base["step_trace_last_rep"] == [[0.0, 256e3, LONG], [256e3, 276e3, SHORT]]
    # Threshold 64 on the same engine: 64 | 64 + 20 | 64 | 64, exactly as a fresh engine.
    apply_config(llm, dict(enable_chunked_prefill=True, max_num_batched_tokens=512,
                           long_prefill_token_threshold=64))
    chunked = run_config(llm, _arrivals(), reps=1, clock_factory=_clock)
    assert [s[2] for s in chunked["step_trace_last_rep"]] == [64, 64 + SHORT, 64, 64]
    assert chunked["long_prefill_steps_last_rep"] == 4
    assert chunked["short_ttft_s"]["p50"] == 64 + 64 + SHORT - 10.0
    assert chunked["long_completion_s"] == LONG + SHORT
    assert llm.scheduler.config.long_prefill_token_threshold == 64
    assert llm.scheduler_config is llm.scheduler.config


def test_warmup_repetitions_are_run_but_not_counted(make_llm: Callable[..., Any]) -> None:
    llm = make_llm(max_num_batched_tokens=512, enable_prefix_caching=False)
    steps = []
    step = llm.step

    def counting() -> Any:
        steps.append(1)
        return step()

    llm.step = counting
    summary = run_config(llm, _arrivals(), reps=2, warmup_reps=1, clock_factory=_clock)
    assert summary["short_ttft_s"]["n"] == 2  # two timed repetitions, one short each
    assert len(summary["long_completion_all_s"]) == 2
    assert len(steps) == 3 * summary["steps_last_rep"]


def test_a_budget_above_the_engines_is_refused(make_llm: Callable[..., Any]) -> None:
    llm = make_llm(max_num_batched_tokens=512)
    with pytest.raises(ValueError, match="exceeds the 512 the engine was built with"):
        apply_config(llm, dict(max_num_batched_tokens=1024))
    assert llm.scheduler.config.max_num_batched_tokens == 512
