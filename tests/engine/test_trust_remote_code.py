"""Issue #25 item 5: ``trust_remote_code``. A checkpoint whose config and model classes are its
own Python files (``auto_map``) is refused without it, in one line naming the flag (the CLI:
exit status 2), and loads, runs its own class and generates with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from pagedcore import LLM
from pagedcore.cli import main
from pagedcore.engine.models.checkpoint import CheckpointError

_CONFIG = """from transformers import LlamaConfig


class MiniConfig(LlamaConfig):
    model_type = "mini_llama"
"""
_MODEL = """from transformers import LlamaForCausalLM

from .configuration_mini import MiniConfig


class MiniForCausalLM(LlamaForCausalLM):
    config_class = MiniConfig
"""


@pytest.fixture(scope="module")
def remote_code_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM

    from pagedcore.engine.models.loading import tiny_config

    root = tmp_path_factory.mktemp("remote_code") / "mini"
    AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(root)
    (root / "configuration_mini.py").write_text(_CONFIG)
    (root / "modeling_mini.py").write_text(_MODEL)
    config = json.loads((root / "config.json").read_text())
    config.update(model_type="mini_llama", architectures=["MiniForCausalLM"], auto_map={
        "AutoConfig": "configuration_mini.MiniConfig",
        "AutoModelForCausalLM": "modeling_mini.MiniForCausalLM"})
    (root / "config.json").write_text(json.dumps(config))
    return root


def test_refused_without_trust_in_one_line(remote_code_checkpoint: Path) -> None:
    kw = dict(device="cpu", max_model_len=32, kv_cache_memory_bytes=1 << 20)
    with pytest.raises(CheckpointError, match="trust_remote_code=True") as info:
        LLM(str(remote_code_checkpoint), **kw)  # type: ignore[arg-type]
    assert "\n" not in str(info.value)
    result = CliRunner().invoke(main, ["generate", "--token-ids", "1,2", "--device", "cpu",
                                       "--model", str(remote_code_checkpoint)])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "--trust-remote-code" in result.output.replace("\n", " ")


def test_loads_its_own_classes_with_trust(remote_code_checkpoint: Path) -> None:
    llm = LLM(str(remote_code_checkpoint), device="cpu", max_model_len=32,
              kv_cache_memory_bytes=1 << 20, trust_remote_code=True)
    assert type(llm.model).__name__ == "MiniForCausalLM"
    assert type(llm.model).__module__.endswith("modeling_mini")  # the checkpoint's file
    [out] = llm.generate([[3, 4, 5]], None)
    assert len(out.outputs[0].token_ids) > 0
