"""`pagedcore bench step` on a tiny CPU shape: rows for overlap on and off, the bytes floor,
the host phases, and the GPU-idle arithmetic on known intervals."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from pagedcore.bench.step import (
    bytes_floor,
    gpu_idle,
    measure_prefix_hit,
    measure_step,
    weight_bytes,
)


def test_gpu_idle_merges_overlapping_intervals() -> None:
    idle = gpu_idle([(0.0, 10.0), (5.0, 12.0), (20.0, 30.0), (29.0, 31.0)])
    assert idle == {"span_us": 31.0, "busy_us": 23.0, "idle_us": 8.0}
    assert gpu_idle([]) is None


def test_bytes_floor_counts_weights_and_kv_once() -> None:
    floor = bytes_floor(weights=4_000_000, kv_per_token=1000, context_tokens=2000,
                        copy_gbps=2.0)
    assert floor["bytes"] == 6_000_000 and floor["floor_ms"] == 3.0
    assert bytes_floor(weights=1, kv_per_token=1, context_tokens=1, copy_gbps=None)[
        "floor_ms"] is None


def test_measure_step_with_and_without_overlap(make_llm: Callable[..., Any]) -> None:
    llm = make_llm(max_num_seqs=4)
    embed = llm.model.get_input_embeddings().weight
    tied = embed is llm.model.get_output_embeddings().weight
    total = sum(p.numel() * 4 for p in llm.model.parameters())
    assert weight_bytes(llm.model) == (total if tied else total - embed.numel() * 4)
    rows = [measure_step(llm, batch=3, context=24, steps=3, overlap=o) for o in (True, False)]
    for row, overlap in zip(rows, (True, False), strict=True):
        assert row["overlap"] is overlap and row["batch"] == 3 and row["step_ms"] > 0
        # Every request decoded through the timed steps: context past the prompt.
        assert row["mean_context"] > 24
        assert set(row["host_ms"]) >= {"schedule", "prepare", "execute", "update"}
    # Nothing is left behind between rows.
    assert not llm.has_unfinished_requests() and llm._inflight is None


def test_measure_step_deltas_takes_the_servers_path(
    make_llm: Callable[..., Any], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``outputs=deltas``: every timed step hands a fresh list to ``step(deltas=...)`` and
    the running requests' tokens arrive there as delta tuples, not `RequestOutput`s."""
    llm = make_llm(max_num_seqs=4)
    calls: list[tuple[int | None, int]] = []
    real_step = llm.step

    def spy(*, finished_only: bool = False, deltas: list[Any] | None = None) -> Any:
        outs = real_step(finished_only=finished_only, deltas=deltas)
        calls.append((None if deltas is None else len(deltas), len(outs)))
        return outs

    monkeypatch.setattr(llm, "step", spy)
    row = measure_step(llm, batch=3, context=24, steps=3, overlap=False, deltas=True)
    assert row["outputs"] == "deltas" and row["mean_context"] > 24
    decoding = [c for c in calls if c[0] is not None and c[0] > 0]
    # the warm-up and timed steps: each delivered the three requests' deltas and no outputs
    assert len(decoding) >= 6 and all(c == (3, 0) for c in decoding[:6]), calls
    assert not llm.has_unfinished_requests()


def test_prefix_hit_is_proven_and_timed_with_and_without_overlap(
    make_llm: Callable[..., Any],
) -> None:
    llm = make_llm(max_num_seqs=4)
    llm.set_async_scheduling(True)
    hit = measure_prefix_hit(llm, prefix=40, user=8, reps=2)
    assert hit["expected_cached_tokens"] == 32 and hit["hits_proven"]  # whole blocks of 16
    for key, steps in (("overlap", 2), ("no_overlap", 1)):
        row = hit[key]
        assert row["num_cached_tokens"] == [32, 32] and len(row["first_token_ms"]) == 2
        # With overlap the token arrives one step() call later; no second forward runs.
        assert row["steps"] == [steps, steps] and row["first_token_ms_median"] > 0
    assert hit["phases_ms"]["execute"] > 0 and set(hit["phases_ms"]) >= {"add", "schedule"}
    assert not llm.has_unfinished_requests() and llm.async_scheduling  # restored
    # Another seed (the bench's next mode) hits its own prefix only, not these prompts.
    again = measure_prefix_hit(llm, prefix=40, user=8, reps=1, seed=1)
    assert again["hits_proven"] and again["no_overlap"]["num_cached_tokens"] == [32]
    llm.add_request("busy", [5] * 10)
    with pytest.raises(ValueError, match="idle engine"):
        measure_prefix_hit(llm, prefix=16)


def test_cli_writes_a_row_per_batch_and_overlap(tmp_path: Path) -> None:
    from pagedcore.bench.cli import bench

    out = tmp_path / "step.json"
    result = CliRunner().invoke(bench, ["step", "--model-shape", "tiny", "--device", "cpu",
                                        "--batch-sizes", "1,2", "--steps", "2",
                                        "--context", "16", "--temperatures", "0,1.5",
                                        "--outputs", "finished", "--prefix-hit", "20",
                                        "--prefix-reps", "1", "--shared-decode",
                                        "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert [(r["batch"], r["temperature"], r["overlap"]) for r in report["rows"]] == [
        (b, t, o) for b in (1, 2) for t in (0.0, 1.5) for o in (True, False)]
    assert {r["outputs"] for r in report["rows"]} == {"finished"}
    assert all(r["floor_ms"] is None and r["bytes"] > r["weight_bytes"] > 0
               for r in report["rows"])
    [shared] = report["shared_decode"]
    assert shared["num_reqs"] == 2 and shared["shared"] == 20
    assert all(shared[f"cascade_{k}"]["decode_tokens_per_s"] > 0 for k in ("off", "on", "auto"))
    [hit] = report["prefix_hit"]
    assert hit["mode"] == "eager" and hit["hits_proven"] and hit["expected_cached_tokens"] == 16
    # How the measured steps ran (on the CPU: all eager, graphs off), per row and per hit.
    assert all(set(r["step_paths"]) == {"eager (graphs off)"} and
               r["step_paths"]["eager (graphs off)"] >= 2 for r in report["rows"])
    assert set(hit["step_paths"]) == {"eager (graphs off)"}
    bad = CliRunner().invoke(bench, ["step", "--batch-sizes", "a,b"])
    assert bad.exit_code == 2 and "'a' in 'a,b' is not an integer" in bad.output
    for option, value, message in (("--temperatures", "0,hot", "comma list of numbers"),
                                   ("--temperatures", "-1", "in [0, 100]"),
                                   ("--outputs", "some", "all, finished, deltas")):
        bad = CliRunner().invoke(bench, ["step", option, value])
        assert bad.exit_code == 2 and message in bad.output, bad.output


def test_engine_bench_takes_the_model_shape(monkeypatch: Any) -> None:
    import pagedcore.bench.engine as engine_bench
    from pagedcore.bench.cli import bench

    seen: dict[str, Any] = {}
    monkeypatch.setattr(engine_bench, "_run_engine_bench", lambda **kw: seen.update(kw))
    ok = CliRunner().invoke(bench, ["engine", "--model", "llama3-8b", "--small"])
    assert ok.exit_code == 0, ok.output
    assert seen["model_name"] == "llama3-8b" and seen["small"] is True
    bad = CliRunner().invoke(bench, ["engine", "--model", "gpt2"])
    assert bad.exit_code == 2 and "qwen2-0.5b" in bad.output
