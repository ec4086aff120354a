"""The engine loop's step trace (``PAGEDCORE_STEP_TRACE``): what it records and its summary."""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Any

import pytest

from pagedcore.bench.serve import RequestResult
from pagedcore.bench.serve import summarize as summarize_run
from pagedcore.engine.llm import LLM
from pagedcore.engine.sampling.sampling_params import SamplingParams
from pagedcore.serve.core_loop import CoreLoop
from pagedcore.serve.step_trace import STEP_TRACE_ENV, StepTrace, read, summarize


def _serve(llm: LLM, trace: StepTrace | None, prompts: list[list[int]],
           max_tokens: int, on_block: Any = None) -> list[tuple[str, Any]]:
    """Run `CoreLoop` over `prompts` (then stop); the items it emitted."""
    commands: deque[Any] = deque(
        ("add", f"r{i}", ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                             temperature=0.0))
        for i, ids in enumerate(prompts))
    emitted: list[tuple[str, Any]] = []

    def recv(block: bool) -> Any:
        if commands:
            return commands.popleft()
        if block and on_block is not None:
            on_block()
        return ("stop",) if block else None

    CoreLoop(llm, lambda items, stats: emitted.extend(items), trace=trace).run(recv)
    return emitted


def test_trace_records_every_step_and_add(tmp_path: Path) -> None:
    llm = LLM("demo", max_num_seqs=4, max_model_len=256)
    path = tmp_path / "trace.jsonl"
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    steps0 = llm.num_steps
    seen_idle: list[int] = []  # step rows on disk while the loop blocks, idle
    emitted = _serve(llm, StepTrace(str(path)), prompts, max_tokens=6, on_block=lambda:
                     seen_idle.append(sum(r["ev"] == "step" for r in read(str(path)))))
    rows = read(str(path))
    steps = [r for r in rows if r["ev"] == "step"]
    assert len(steps) == llm.num_steps - steps0 > 0
    assert seen_idle == [len(steps)]  # flushed before blocking: a reader sees every step
    assert sum(r["add"] for r in rows if r["ev"] == "cmd") == 3
    assert sum(r["items"] for r in steps) == len(emitted)  # every item handed over is counted
    assert all(0 <= r["running"] <= 3 and r["waiting"] >= 0 for r in steps)
    assert sum(r["tokens"] for r in steps) == sum(map(len, prompts)) + 3 * (6 - 1)
    assert [r["t"] for r in rows] == sorted(r["t"] for r in rows)
    # The loop blocked before the first command and after the last request finished.
    assert [r["ev"] for r in rows if r["ev"] == "wait"] == ["wait", "wait"]
    assert rows[0]["ev"] == rows[-1]["ev"] == "wait"
    s = summarize(rows)
    assert s["steps"] == len(steps) and s["commands"] == 3
    assert s["first_add"] == next(r["t"] for r in rows if r["ev"] == "cmd")
    assert s["span_s"] == pytest.approx(s["last_step_end"] - s["first_add"])
    assert s["step_s"] > 0 and s["other_s"] >= -1e-9
    # A window before the first event holds nothing.
    empty = summarize(rows, end=rows[0]["t"] - 1.0)
    assert (empty["steps"], empty["span_s"]) == (0, None)


def test_trace_is_off_unless_the_variable_names_a_file(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(STEP_TRACE_ENV, raising=False)
    assert StepTrace.from_env() is None
    monkeypatch.setenv(STEP_TRACE_ENV, " ")
    assert StepTrace.from_env() is None
    monkeypatch.setenv(STEP_TRACE_ENV, str(tmp_path / "t.jsonl"))
    trace = StepTrace.from_env()
    assert trace is not None
    trace.close()


def test_traced_loop_emits_what_the_plain_loop_does(tmp_path: Path) -> None:
    prompts = [[3, 4, 5], [6, 7, 8, 9]]
    plain = _serve(LLM("demo", max_num_seqs=4, max_model_len=256), None, prompts, 5)
    traced = _serve(LLM("demo", max_num_seqs=4, max_model_len=256),
                    StepTrace(str(tmp_path / "t.jsonl")), prompts, 5)
    assert traced == plain


def test_run_summary_gives_the_clock_of_its_edges() -> None:
    results = [RequestResult(ok=True, start=10.0 + i, ttft=0.5, e2e=2.0 + i, output_tokens=3)
               for i in range(3)]
    results.append(RequestResult(ok=False, start=11.5, error="HTTP 503"))
    clock = summarize_run(results, 6.0)["clock"]
    assert clock == {"first_send": 10.0, "last_send": 12.0, "first_token": 10.5,
                     "last_token": 16.0}


def test_trace_records_collections_and_stops_watching(tmp_path: Path) -> None:
    """A collection of generation >= 1 while the loop runs is a ``gc`` row; the loop's
    callback is gone once it stops."""
    import gc

    llm = LLM("demo", max_num_seqs=2, max_model_len=128)
    path = tmp_path / "trace.jsonl"
    callbacks = len(gc.callbacks)
    _serve(llm, StepTrace(str(path), proc="engine"), [[5, 6, 7]], max_tokens=2,
           on_block=lambda: gc.collect(1))
    assert len(gc.callbacks) == callbacks
    rows = [r for r in read(str(path)) if r["ev"] == "gc"]
    assert rows and {r["proc"] for r in rows} == {"engine"}
    assert all(r["gen"] >= 1 and r["s"] >= 0 for r in rows)
    gc.collect(1)  # after the loop: not recorded
    assert len([r for r in read(str(path)) if r["ev"] == "gc"]) == len(rows)


def test_summary_merges_the_front_file_and_clips_idle(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    engine = StepTrace(str(path))
    engine.row({"ev": "cmd", "t": 1.0, "add": 2, "other": 0})
    engine.step(1.1, 0.5, 0.1, items=2, running=2, waiting=0, tokens=9)
    engine.row({"ev": "gc", "t": 1.3, "s": 0.2, "gen": 2, "proc": "engine"})
    engine.wait(1.8, 30.0)  # idle until long after the window's end (2.0)
    engine.close()
    with open(str(path) + ".front", "w") as f:
        f.write('{"ev":"gc","t":1.5,"s":0.05,"gen":1,"proc":"front"}\n')
        f.write('{"ev":"gc","t":1.6,"s":0.15,"gen":2,"proc":"front"}\n')
    rows = read(str(path))
    assert [r["t"] for r in rows] == [1.0, 1.1, 1.3, 1.5, 1.6, 1.8]
    s = summarize(rows, 0.5, 2.0)
    assert s["wait_s"] == pytest.approx(0.2)  # 1.8 .. 2.0, not 30 s
    assert s["gc"] == {"engine": {"n": 1, "s": 0.2, "max_s": 0.2},
                       "front": {"n": 2, "s": pytest.approx(0.2), "max_s": 0.15}}
    assert s["other_s"] == pytest.approx(s["span_s"] - 0.5 - 0.1 - 0.2)
