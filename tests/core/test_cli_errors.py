"""Issue #27 / #25 item 7: every CLI user mistake is a one-line error with exit code 2,
found before any run starts (these cases take milliseconds: nothing runs)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from pagedcore.cli import main
from pagedcore.cli_types import IntList


@pytest.fixture(autouse=True)
def _no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _usage_error(args: list[str], needle: str) -> Result:
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, (args, result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.output
    assert needle in result.output.replace("\n", " "), result.output
    return result


@pytest.mark.parametrize(("args", "needle"), [
    (["generate", "--prompt", "x", "--device", "foo"], "'foo' is not a device"),
    (["generate", "--prompt", "x", "--device", "cuda"], "no CUDA device is available here"),
    (["generate", "--prompt", "x", "--backend", "nope"], "registered backends:"),
    (["generate", "--prompt", "x", "--max-tokens", "0"], "--max-tokens"),
    (["demo", "--num-requests", "0"], "--num-requests"),
    (["demo", "--threads", "0"], "--threads"),
    (["demo", "--device", "cdua"], "'cdua' is not a device"),
    (["generate", "--prompt", "x", "--dtype", "float64"], "--dtype"),
    (["generate", "--prompt", "x", "--kv-cache-dtype", "int8"], "--kv-cache-dtype"),
    (["bench", "engine", "--num-prompts", "-1"], "--num-prompts"),
    (["bench", "engine", "--max-new", "0"], "--max-new"),
    (["bench", "memory", "--budget-mib", "0"], "--budget-mib"),
    (["bench", "tp", "--sizes", "0"], "0 in '0' is below the minimum 1"),
    (["bench", "prefix", "--lengths", "abc"], "'abc' in 'abc' is not an integer"),
    (["bench", "chunked", "--budgets", "512,x"], "'x' in '512,x' is not an integer"),
    (["bench", "chunked", "--budgets", "0"], "below the minimum 1"),
    (["bench", "chunked", "--pairs", "9:3"], "need 0 < threshold <= budget"),
    (["bench", "kernels", "--backend", "nope"], "registered backends: "),
    (["bench", "backends", "--backend", "nope"], "reference"),
    (["conformance", "nope"], "unknown attention backend 'nope'"),
    (["conformance", "reference", "-k", "no_such_case"], "matches none of the"),
    # The engine options (generated from EngineArgs) check the same way on every command.
    (["serve", "demo", "--device", "cdua"], "'cdua' is not a device"),
    (["serve", "demo", "--kv-cache-memory", "2x"], "not a size such as 4GiB"),
    (["serve", "demo", "--kv-cache-dtype", "int4"], "--kv-cache-dtype"),
    (["serve", "demo", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["bench", "engine", "--block-size", "0"], "--block-size"),
    (["bench", "tp", "--device", "cuda"], "no CUDA device is available here"),
    (["bench", "prefix", "--max-num-seqs", "x"], "--max-num-seqs"),
    (["generate", "--prompt", "x", "--model", "./no/such/dir"], "does not exist"),
    # NaN and infinity pass a range check (every comparison with NaN is false).
    (["demo", "--kv-cache-mb", "nan"], "'nan' is not a finite number"),
    (["demo", "--kv-cache-mb", "inf"], "'inf' is not a finite number"),
    (["generate", "--prompt", "x", "--temperature", "nan"], "not a finite number"),
])
def test_cli_mistake_is_a_usage_error(args: list[str], needle: str) -> None:
    _usage_error(args, needle)


def test_conformance_json_into_missing_directory_fails_before_the_suite(tmp_path: Path) -> None:
    result = _usage_error(["conformance", "reference", "--quick", "--json",
                           str(tmp_path / "no" / "r.json")], "does not exist")
    assert "PASSED" not in result.output  # nothing ran


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM

    from pagedcore.engine.models.loading import tiny_config

    path = tmp_path_factory.mktemp("cli_ckpt") / "good"
    AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(path)
    return path


def test_generate_model_mistakes(checkpoint: Path, tmp_path: Path) -> None:
    base = ["generate", "--token-ids", "1,2,3", "--device", "cpu", "--model"]
    _usage_error([*base, str(tmp_path / "missing")], "does not exist")
    bad_json = tmp_path / "bad_json"
    shutil.copytree(checkpoint, bad_json)
    (bad_json / "config.json").write_text("{oops")
    _usage_error([*base, str(bad_json)], "is not readable JSON")
    truncated = tmp_path / "truncated"
    shutil.copytree(checkpoint, truncated)
    (truncated / "model.safetensors").write_bytes(b"\x08")
    _usage_error([*base, str(truncated)], "corrupt or truncated")
    shapes = tmp_path / "shapes"
    shutil.copytree(checkpoint, shapes)
    from pagedcore.engine.models.loading import tiny_config

    tiny_config("llama", hidden_size=32, head_dim=8).save_pretrained(shapes)
    _usage_error([*base, str(shapes)], "do not match")
    # A bad value that transformers' own config checks reject (any exception type).
    import json

    for field, value in (("num_attention_heads", 0), ("num_hidden_layers", "2"),
                         ("dtype", "float99")):
        bad_value = tmp_path / f"bad_{field}"
        shutil.copytree(checkpoint, bad_value)
        config = json.loads((bad_value / "config.json").read_text())
        config[field] = value
        (bad_value / "config.json").write_text(json.dumps(config))
        _usage_error([*base, str(bad_value)], "is not a usable transformers config")
    # generation_config.json's EOS id that is no token id: named with its file.
    bad_eos = tmp_path / "bad_eos"
    shutil.copytree(checkpoint, bad_eos)
    (bad_eos / "generation_config.json").write_text('{"eos_token_id": "x"}')
    _usage_error([*base, str(bad_eos)], "generation_config.json's eos_token_id must be a token")


def test_serve_refuses_an_unwritable_step_trace_before_loading(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDCORE_STEP_TRACE", str(tmp_path / "no" / "such" / "trace.jsonl"))
    _usage_error(["serve", "demo", "--port", "1"], "PAGEDCORE_STEP_TRACE=")


def test_generate_reports_a_failed_step_with_what_it_produced(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend raising mid-forward: exit 1, one error line, the request's output printed,
    no traceback."""
    from pagedcore.reference.impl import ReferenceImpl

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("kernel launch failed")

    monkeypatch.setattr(ReferenceImpl, "forward", broken)
    result = CliRunner().invoke(main, ["generate", "--token-ids", "1,2,3", "--device", "cpu",
                                       "--backend", "reference", "--max-tokens", "2"])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and "kernel launch failed" in result.output
    assert "[gen-0]" in result.output and "error" in result.output


def test_int_list_parses_and_keeps_order() -> None:
    assert IntList(1).convert("512, 1024,", None, None) == [512, 1024]
