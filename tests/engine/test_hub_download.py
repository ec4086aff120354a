"""Issue #25 item 5: a model id downloads when the hub is reachable. A fake hub on 127.0.0.1
(`fake_hub.FakeHub`: the endpoints `huggingface_hub.snapshot_download` calls) serves a tiny
checkpoint; ``HF_ENDPOINT`` points at it, ``HF_HOME`` / ``HF_HUB_CACHE`` at a temporary
directory, ``HF_HUB_OFFLINE`` is unset."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from fake_hub import COMMIT, FakeHub

from pagedcore import LLM
from pagedcore.cli import main
from pagedcore.engine.models.hub import ModelNotFoundError


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM

    from pagedcore.engine.models.loading import tiny_config

    path = tmp_path_factory.mktemp("hub_repo")
    AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(path)
    (path / "README.md").write_text("not fetched: only config, weights and tokenizer files")
    return path


@pytest.fixture()
def hub(checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """The fake hub serving ``tiny-org/tiny-llama``, and huggingface_hub pointed at it (the
    environment for anything that reads it later, the constants it read at import too)."""
    from huggingface_hub import constants

    fake = FakeHub({"tiny-org/tiny-llama": checkpoint})
    home = tmp_path / "hf_home"
    for name, value in (("HF_ENDPOINT", fake.endpoint), ("HF_HOME", str(home)),
                        ("HF_HUB_CACHE", str(home / "hub"))):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", fake.endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        fake.endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    yield fake
    fake.stop()


def test_model_id_downloads_from_the_hub_and_generates(hub: FakeHub, tmp_path: Path) -> None:
    llm = LLM("tiny-org/tiny-llama", device="cpu", max_model_len=32,
              kv_cache_memory_bytes=1 << 20)
    assert llm.model.config.model_type == "llama"
    [out] = llm.generate([[3, 4, 5]], None)
    assert len(out.outputs[0].token_ids) > 0
    snapshot = tmp_path / "hf_home" / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT
    assert (snapshot / "config.json").is_file() and (snapshot / "model.safetensors").is_file()
    assert not (snapshot / "README.md").exists()  # outside the download patterns
    fetched = [p for m, p in hub.requests if m == "GET" and "/resolve/" in p]
    assert sorted(p.rsplit("/", 1)[1] for p in fetched) == [
        "config.json", "generation_config.json", "model.safetensors"]
    # Now cached: a second engine loads without asking the hub for any file again.
    before = len(hub.requests)
    LLM("tiny-org/tiny-llama", device="cpu", max_model_len=32, kv_cache_memory_bytes=1 << 20)
    assert not [p for m, p in hub.requests[before:] if "/resolve/" in p and m == "GET"]


def _one_line_usage_error(args: list[str], needle: str) -> None:
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.output
    assert needle in result.output.replace("\n", " "), result.output


def test_unknown_id_and_unreachable_hub_are_one_line_errors(
    hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    with pytest.raises(ModelNotFoundError, match="has no model 'tiny-org/no-such-model'") as info:
        LLM("tiny-org/no-such-model", device="cpu")
    assert "\n" not in str(info.value)
    args = ["generate", "--token-ids", "1,2", "--device", "cpu", "--model"]
    _one_line_usage_error([*args, "tiny-org/no-such-model"], "has no model")
    # The hub gone (nothing listens on the endpoint any more).
    hub.stop()
    with pytest.raises(ModelNotFoundError, match="could not be reached") as info:
        LLM("tiny-org/other-model", device="cpu")
    assert "\n" not in str(info.value) and constants.HF_HUB_CACHE in str(info.value)
    _one_line_usage_error([*args, "tiny-org/other-model"], "HF_HUB_OFFLINE=1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    _one_line_usage_error([*args, "tiny-org/other-model"], "HF_HUB_OFFLINE is set")
