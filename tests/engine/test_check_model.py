"""Issue #25 item 5: `pagedcore check-model` (and `check_model`) verifies greedy parity with
transformers and reports it; a model that cannot run gets its reason and exit status 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from pagedcore.cli import main
from pagedcore.engine.engine_args import EngineArgs
from pagedcore.engine.models.check_model import check_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM

    from pagedcore.engine.models.loading import tiny_config

    path = tmp_path_factory.mktemp("check_model") / "tiny-qwen3"
    AutoModelForCausalLM.from_config(tiny_config("qwen3")).save_pretrained(path)
    return path


def test_check_model_passes_and_writes_json(checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    result = CliRunner().invoke(main, ["check-model", str(checkpoint), "--device", "cpu",
                                       "--num-tokens", "4", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "greedy tokens identical on 2/2 prompts of 4 tokens" in result.output
    report = json.loads(out.read_text())
    assert report["passed"] and report["model_type"] == "qwen3"
    assert report["max_logprob_diff"] < 1e-4


def test_a_wrong_engine_fails_the_check(checkpoint: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import pagedcore.engine.runner.model_runner as runner

    monkeypatch.setattr(runner, "output_logit_scale", lambda config: 3.0)  # a planted bug
    found = check_model(EngineArgs(model=str(checkpoint), device="cpu"), num_tokens=4)
    assert not found.passed and found.max_logprob_diff is not None
    assert found.max_logprob_diff > 1e-2 and "FAILED" in found.summary()
    result = CliRunner().invoke(main, ["check-model", str(checkpoint), "--device", "cpu",
                                       "--num-tokens", "4"])
    assert result.exit_code == 1, result.output


def test_unrunnable_architecture_is_a_usage_error_with_the_reason(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(
        tmp_path / "gpt2")
    result = CliRunner().invoke(main, ["check-model", str(tmp_path / "gpt2"), "--device",
                                       "cpu"])
    assert result.exit_code == 2, result.output
    assert "transformer.h" in result.output and "Traceback" not in result.output
