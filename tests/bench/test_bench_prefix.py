"""The prefix experiment proves its hits through num_cached_tokens, on a virtual clock."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedcore.bench.prefix import chat_trace, measure_prefix
from pagedcore.bench.timeline import VirtualClock


def test_cold_requests_never_hit_and_warm_ones_hit_the_whole_shared_prefix(
    make_llm: Callable[..., Any],
) -> None:
    llm = make_llm(max_num_batched_tokens=512)
    clock = VirtualClock(per_token=1.0)
    rows = measure_prefix(llm, lengths=[64, 200], reps=2, user_len=8, vocab=128, clock=clock)
    for row, length in zip(rows, (64, 200), strict=True):
        hit = (length // 16) * 16
        assert row["cold_num_cached_tokens"] == [0, 0]
        assert row["warm_num_cached_tokens"] == [hit, hit]
        assert row["expected_warm_hit_tokens"] == hit
        assert row["hits_proven"] is True
        # On the virtual clock TTFT is the tokens computed: the hit is skipped, exactly.
        assert row["cold_ttft_s"] == [length + 8.0] * 2
        assert row["warm_ttft_s"] == [length + 8.0 - hit] * 2
        assert row["speedup"] == (length + 8.0) / (length + 8.0 - hit)


def test_no_hits_are_claimed_with_prefix_caching_off(make_llm: Callable[..., Any]) -> None:
    llm = make_llm(enable_prefix_caching=False)
    rows = measure_prefix(llm, lengths=[64], reps=1, user_len=8, vocab=128,
                          clock=VirtualClock(per_token=1.0))
    assert rows[0]["warm_num_cached_tokens"] == [0]
    assert rows[0]["hits_proven"] is False
    assert rows[0]["speedup"] == 1.0


def test_chat_turns_reuse_the_whole_history_including_replies(
    make_llm: Callable[..., Any],
) -> None:
    on = chat_trace(make_llm(), turns=3, system_len=40, user_len=10, reply_len=6, vocab=128,
                    prefix="on", clock=VirtualClock(per_token=1.0))
    off = chat_trace(make_llm(enable_prefix_caching=False), turns=3, system_len=40,
                     user_len=10, reply_len=6, vocab=128, prefix="off",
                     clock=VirtualClock(per_token=1.0))
    assert [r["prompt_tokens"] for r in on] == [50, 66, 82]  # history + reply + new user turn
    assert [r["prompt_tokens"] for r in off] == [50, 66, 82]
    assert [r["num_cached_tokens"] for r in off] == [0, 0, 0]
    # Turn k's cache covers the full blocks of turn k-1's prompt and its reply tokens
    # (the last reply token was never fed back, so it has no KV).
    assert on[0]["num_cached_tokens"] == 0
    assert on[1]["num_cached_tokens"] == ((50 + 6 - 1) // 16) * 16
    assert on[2]["num_cached_tokens"] == ((66 + 6 - 1) // 16) * 16
    assert all(a["ttft_s"] < b["ttft_s"] for a, b in zip(on[1:], off[1:], strict=True))


def test_shared_prefix_decode_workload_runs_both_modes(make_llm: Callable[..., Any]) -> None:
    from pagedcore.bench.prefix_shared import measure_shared_decode

    llm = make_llm(max_num_batched_tokens=512)
    seen: list[tuple[int, ...]] = []
    real = llm.runner.cascade.plan

    def spy(*args: Any) -> Any:
        shared, use = real(*args)
        seen.append(use)
        return shared, use

    llm.runner.cascade.plan = spy
    row = measure_shared_decode(llm, num_reqs=3, shared=40, own=5, max_tokens=2, vocab=128)
    assert row["cascade_on"]["num_cached_tokens_min"] == 32  # the shared prompt's full blocks
    assert row["cascade_off"]["decode_tokens_per_s"] > 0 and row["speedup"] > 0
    assert any(any(u) for u in seen)  # the forced-on run cascaded (the reference: plainly)
    assert llm.runner.cascade.mode == "auto"  # restored


def test_shared_prefix_decode_reports_no_rate_without_decode_time(
    make_llm: Callable[..., Any], monkeypatch: Any,
) -> None:
    """A timed pair whose longer run is not slower gives no rate (None and a reason), never a
    division by a clamped zero."""
    import pagedcore.bench.prefix_shared as shared_mod

    ticks = iter([10.0, 11.0, 20.0, 20.5] * 2)  # prefill-only 1.0 s, with decode 0.5 s
    monkeypatch.setattr(shared_mod, "_clock", lambda: next(ticks))
    row = shared_mod.measure_shared_decode(make_llm(max_num_batched_tokens=512), num_reqs=2,
                                           shared=20, own=3, max_tokens=1, vocab=128)
    for key in ("cascade_off", "cascade_on"):
        assert row[key]["decode_tokens_per_s"] is None and "no decode time" in row[key]["error"]
    assert row["speedup"] is None


def test_cli_shared_decode_only_runs_just_that_workload(tmp_path: Any) -> None:
    import json

    from click.testing import CliRunner

    from pagedcore.cli import main

    out = tmp_path / "sd.json"
    res = CliRunner().invoke(main, ["bench", "prefix", "--small", "--shared-decode-only",
                                    "--device", "cpu", "--json", str(out)])
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    row = report["shared_prefix_decode"]
    assert row["num_reqs"] == 8 and row["shared"] == 512
    assert row["cascade_on"]["num_cached_tokens_min"] == 512
    assert report["shared_system_prompt"] == []  # the TTFT figures were not run
    assert report["engine_config"]["max_model_len"] >= 512 + 32 + 8


def test_shared_prefix_decode_refuses_requests_cut_short(make_llm: Callable[..., Any]) -> None:
    """An engine whose max_model_len ends the requests before their decode tokens: an error
    that says so, never a rate that counts tokens that were not generated."""
    import pytest

    from pagedcore.bench.prefix_shared import measure_shared_decode

    llm = make_llm(max_num_batched_tokens=512)
    room = llm.max_model_len - 40 - 5  # shared + own fill the rest
    with pytest.raises(ValueError, match=r"generated \d+ tokens, not \d+ \(max_model_len"):
        measure_shared_decode(llm, num_reqs=2, shared=40, own=5, max_tokens=room + 3,
                              vocab=128)
