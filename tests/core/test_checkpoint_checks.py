"""Issue #27: checkpoints that would load silently wrong are errors naming the file."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest

from pagedcore.engine.models.checkpoint import CheckpointError
from pagedcore.engine.models.loading import load_model, tiny_config


def _load(path: Path | str, **kwargs: object) -> object:
    import torch

    return load_model(str(path), dtype=torch.float32, device=torch.device("cpu"), **kwargs)


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("ckpt") / "good"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(path)
    return path


def _copy(good: Path, tmp_path: Path, name: str) -> Path:
    target = tmp_path / name
    shutil.copytree(good, target)
    return target


def test_good_checkpoint_loads(good: Path) -> None:
    loaded = _load(good)
    assert loaded.model.config.num_hidden_layers == 2  # type: ignore[attr-defined]


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist; check the path"):
        _load(tmp_path / "nope")


def test_config_with_more_layers_than_weights(good: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    path = _copy(good, tmp_path, "more")
    tiny_config("llama", num_hidden_layers=3).save_pretrained(path)
    with pytest.raises(CheckpointError, match=r"does not have.*model\.layers\.2\..*"
                                              r"PAGEDCORE_SKIP_CHECKPOINT_CHECKS=1"):
        _load(path)
    monkeypatch.setenv("PAGEDCORE_SKIP_CHECKPOINT_CHECKS", "1")  # the opt-out
    assert _load(path).model.config.num_hidden_layers == 3  # type: ignore[attr-defined]


def test_unexpected_weights(good: Path, tmp_path: Path) -> None:
    path = _copy(good, tmp_path, "fewer")
    tiny_config("llama", num_hidden_layers=1).save_pretrained(path)
    with pytest.raises(CheckpointError, match=r"no place for.*model\.layers\.1\."):
        _load(path)


def test_nan_weights(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] = math.nan
    model.save_pretrained(tmp_path / "nan")
    with pytest.raises(CheckpointError, match=r"NaN or inf.*layers\.1\.mlp\.up_proj\.weight"):
        _load(tmp_path / "nan")
    assert _load(tmp_path / "nan", strict=False) is not None


def test_shape_mismatch_and_truncated_weights(good: Path, tmp_path: Path) -> None:
    path = _copy(good, tmp_path, "shape")
    tiny_config("llama", intermediate_size=96).save_pretrained(path)
    with pytest.raises(CheckpointError, match=r"do not match config\.json"):
        _load(path)
    path = _copy(good, tmp_path, "trunc")
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        _load(path)


@pytest.mark.parametrize("content", ["{not json", ""])
def test_non_json_config(good: Path, tmp_path: Path, content: str) -> None:
    path = _copy(good, tmp_path, "cfg")
    (path / "config.json").write_text(content)
    with pytest.raises(CheckpointError, match=r"config\.json is not readable JSON"):
        _load(path)


def test_corrupt_tokenizer_json(good: Path, tmp_path: Path) -> None:
    path = _copy(good, tmp_path, "tok")
    (path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(CheckpointError, match=r"tokenizer\.json is not readable JSON"):
        _load(path)
    (path / "tokenizer.json").write_text('{"version": "1.0"}')  # valid JSON, not a tokenizer
    with pytest.raises(CheckpointError, match=r"the tokenizer of .* cannot be loaded"):
        _load(path)
