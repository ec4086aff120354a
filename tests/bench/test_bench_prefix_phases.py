"""The per-phase breakdown of a request's first token: phases add up, shims go away."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedcore.bench.prefix_phases import PHASES, phase_breakdown, timed_phases
from pagedcore.engine.scheduling.scheduler import Scheduler


def test_breakdown_covers_every_step_and_reports_hits(make_llm: Callable[..., Any]) -> None:
    llm = make_llm(max_num_batched_tokens=512)
    shared = [3 + i % 50 for i in range(96)]
    prime = phase_breakdown(llm, [shared + [9] * 8], label="prime")
    assert prime["num_cached_tokens"] == [0]
    warm = phase_breakdown(llm, [shared + [11] * 8, shared + [12] * 8], label="warm",
                           max_tokens=3)
    assert warm["n"] == 2 and warm["steps"] == [3, 3]
    assert warm["num_cached_tokens"] == [96, 96]
    assert warm["mixed_graph_replays"] == [None, None]  # CPU: no mixed graphs
    phases = warm["phases_ms"]
    assert set(phases) == set(PHASES)
    assert all(phases[p] > 0 for p in ("add", "schedule", "prepare", "execute", "sample"))
    # The phases are disjoint parts of the request's time.
    assert sum(phases.values()) <= warm["total_ms"] * 1.05
    assert not llm.has_unfinished_requests()


def test_shims_are_removed_even_when_the_step_raises(make_llm: Callable[..., Any]) -> None:
    llm = make_llm()
    sink: dict[str, float] = {}
    try:
        with timed_phases(llm, None, sink):
            assert "schedule" in vars(llm.scheduler)
            llm.scheduler.schedule()
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert sink["schedule"] > 0
    assert "schedule" not in vars(llm.scheduler)
    assert type(llm.scheduler).schedule is Scheduler.schedule
    assert "execute" not in vars(llm.runner) and "sample" not in vars(llm.sampler)
