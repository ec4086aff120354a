"""Issue #25 items 7-8: model mistakes are one-line usage errors (exit 2) that say what is
missing; the conformance suite reports each case as it finishes (the progress bar); the
engine's periodic stats line goes through `logging`, off in the library."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from click.testing import CliRunner

from pagedcore.cli import main


def _usage_error(args: list[str]) -> str:
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, (result.output, result.exception)
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.output
    return result.output.replace("\n", " ")


def test_unknown_model_id_names_the_cache(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    out = _usage_error(["generate", "--token-ids", "1,2", "--device", "cpu", "--model",
                        "no-such-org/no-such-model"])
    assert "Hugging Face cache" in out and "HF_HUB_OFFLINE" in out


def test_checkpoint_without_tokenizer_says_which_files(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from pagedcore.engine.models.loading import tiny_config

    AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(tmp_path / "ckpt")
    out = _usage_error(["generate", "--prompt", "hello", "--device", "cpu", "--model",
                        str(tmp_path / "ckpt"), "--no-log-stats"])
    assert "ships no tokenizer" in out and "tokenizer.json" in out and "--token-ids" in out


def test_conformance_reports_every_case_as_it_finishes() -> None:
    from pagedcore.conformance.runner import run_suite

    seen: list[str] = []
    report = run_suite("reference", quick=True, device="cpu", case_filter="decode",
                       on_result=lambda result: seen.append(result.name))
    assert seen and seen == [r.name for r in report.results]


def test_stats_line_fields_and_interval() -> None:
    from pagedcore.engine.stats_logging import StatsLogger

    now = [0.0]
    stats = {"running": 3, "waiting": 1, "kv_cache_usage": 0.25, "prompt_tokens": 200,
             "prefix_hit_tokens": 50, "prefix_hit_rate": 0.25}
    log = StatsLogger(2.0, clock=lambda: now[0])
    now[0] = 1.0
    assert log.maybe_log(lambda: stats, 10) is None  # not due yet
    now[0] = 2.0
    line = log.maybe_log(lambda: stats, 40)
    assert line == ("Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: "
                    "20.0 tokens/s, Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, "
                    "Prefix cache hit rate: 25.0%")
    now[0] = 4.0  # the next interval: only what happened since the last line
    line = log.maybe_log(lambda: {**stats, "prompt_tokens": 300, "prefix_hit_tokens": 150}, 50)
    assert line is not None
    assert "prompt throughput: 50.0" in line and "generation throughput: 5.0" in line
    assert "hit rate: 100.0%" in line


def test_engine_logs_stats_only_when_asked(caplog: pytest.LogCaptureFixture) -> None:
    from pagedcore import LLM, SamplingParams

    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    kw = dict(device="cpu", max_model_len=64, kv_cache_memory_bytes=1 << 20)
    with caplog.at_level(logging.INFO, logger="pagedcore.engine"):
        LLM("demo", **kw).generate([[5, 6, 7]], params)
        assert not [r for r in caplog.records if "throughput" in r.getMessage()]
        LLM("demo", log_stats=True, log_interval=1e-9, **kw).generate([[5, 6, 7]], params)
    lines = [r.getMessage() for r in caplog.records if r.name == "pagedcore.engine"]
    assert len(lines) >= 3 and all("Avg generation throughput" in line for line in lines)
