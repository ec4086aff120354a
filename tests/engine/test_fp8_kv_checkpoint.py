"""fp8 KV-cache scales from a checkpoint's ``self_attn.k_scale`` / ``v_scale`` tensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedcore.engine.llm import LLM
from pagedcore.engine.models.checkpoint import CheckpointError
from pagedcore.engine.models.loading import load_model, tiny_config


def _checkpoint(path: Path, scales: dict[str, float]) -> Path:
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(path)
    weights = load_file(str(path / "model.safetensors"))
    for name, value in scales.items():
        weights[f"model.layers.{name}"] = torch.tensor(value, dtype=torch.float32)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


FULL = {"0.self_attn.k_scale": 0.02, "0.self_attn.v_scale": 0.03,
        "1.self_attn.k_scale": 0.04, "1.self_attn.v_scale": 0.05}


def test_scales_from_the_checkpoint_reach_every_layer(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path / "ok", FULL)
    llm = LLM(str(path), device="cpu", max_model_len=64, kv_cache_dtype="fp8",
              enforce_eager=True)
    status = llm.stats()["kv_scales"]
    assert status["source"] == "checkpoint"
    assert status["k_scale_range"] == pytest.approx([0.02, 0.04])
    assert status["v_scale_range"] == pytest.approx([0.03, 0.05])
    layers = sorted(llm.runner.layers.items())  # type: ignore[union-attr]
    got = [(b.impl.k_scale, b.impl.v_scale) for _, b in layers]
    assert got == [pytest.approx((0.02, 0.03)), pytest.approx((0.04, 0.05))]


@pytest.mark.parametrize(("scales", "message"), [
    ({"0.self_attn.k_scale": 0.02, "0.self_attn.v_scale": 0.03}, r"not for layers \[1\]"),
    ({**FULL, "1.self_attn.v_scale": float("nan")}, "layer 1 v_scale is nan"),
    ({**FULL, "0.self_attn.k_scale": 0.0}, "layer 0 k_scale is 0.0"),
])
def test_bad_checkpoint_scales_name_the_layer(tmp_path: Path, scales: dict[str, float],
                                              message: str) -> None:
    path = _checkpoint(tmp_path / "bad", scales)
    with pytest.raises(CheckpointError, match=message):
        load_model(str(path), dtype=torch.float32, device=torch.device("cpu"))
