"""The engine experiments' model choice (``--model``): config shapes and the CLI option reaching
the engine (CPU runs use ``--small``: a tiny model of the chosen architecture)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from pagedcore.bench.cli import bench
from pagedcore.bench.report import (
    BENCH_MODELS,
    bench_model_config,
    engine_bench_model,
    model_shape,
)


def _run(args: list[str]) -> None:
    result = CliRunner().invoke(bench, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output


def test_llama3_8b_shape() -> None:
    config = bench_model_config("llama3-8b")
    shape = model_shape(config, dtype=torch.bfloat16, kv_dtype=torch.bfloat16, name="llama3-8b")
    assert shape["name"] == "llama3-8b"
    assert (shape["model_type"], shape["num_hidden_layers"], shape["hidden_size"]) == (
        "llama", 32, 4096)
    assert (shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]) == (
        32, 8, 128)
    assert (shape["intermediate_size"], shape["vocab_size"]) == (14336, 128256)
    assert config.rope_parameters["rope_theta"] == 500000.0
    # Llama-3-8B has 8.03e9 parameters (untied embeddings); the 0.5B shape 0.494e9 (tied).
    assert shape["num_parameters_approx"] == pytest.approx(8.03e9, rel=2e-3)
    small = model_shape(bench_model_config("qwen2-0.5b"), dtype=torch.bfloat16,
                        kv_dtype=torch.bfloat16)
    assert small["num_parameters_approx"] == pytest.approx(0.494e9, rel=2e-3)
    assert "name" not in small


def test_llama3_8b_builds_without_host_weights() -> None:
    """Built on the meta device (as on a GPU: created where they live, never on the host
    first): the parameter count is Llama-3-8B's and nothing is materialised."""
    from pagedcore.engine.models.loading import random_model

    config = bench_model_config("llama3-8b")
    model = random_model(config, dtype=torch.bfloat16, device=torch.device("meta"))
    params = list(model.parameters())
    assert all(p.device.type == "meta" and p.dtype == torch.bfloat16 for p in params)
    exact = sum(p.numel() for p in params)
    norms = (2 * 32 + 1) * 4096  # RMSNorm weights, left out of the approximate count
    assert exact == model_shape(config, dtype=torch.bfloat16,
                                kv_dtype=torch.bfloat16)["num_parameters_approx"] + norms


def test_engine_bench_model_choices_and_errors() -> None:
    assert BENCH_MODELS[0] == "qwen2-0.5b"
    dev, dtype, config = engine_bench_model(False, "cpu")
    assert (dev.type, dtype, config.model_type, config.hidden_size) == (
        "cpu", torch.float32, "qwen2", 896)
    _, _, big = engine_bench_model(False, "cpu", "llama3-8b", max_position_embeddings=40000)
    assert (big.hidden_size, big.max_position_embeddings) == (4096, 40000)
    _, _, tiny = engine_bench_model(True, "cpu", "llama3-8b")
    assert (tiny.model_type, tiny.num_hidden_layers, tiny.num_key_value_heads) == ("llama", 2, 1)
    assert engine_bench_model(True, "cpu")[2].model_type == "qwen2"
    with pytest.raises(ValueError, match="choose one of"):
        bench_model_config("llama3-70b")


def test_model_option_reaches_the_prefix_engine(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    _run(["prefix", "--small", "--model", "llama3-8b", "--device", "cpu", "--lengths", "48",
          "--reps", "1", "--no-phases", "--json", str(out)])
    report = json.loads(out.read_text())
    model = report["model"]
    assert (model["name"], model["model_type"], model["num_key_value_heads"]) == (
        "llama3-8b (small)", "llama", 1)
    assert model["init_seconds"] >= 0
    assert all(r["hits_proven"] for r in report["shared_system_prompt"])


def test_model_option_reaches_the_chunked_engine(tmp_path: Path) -> None:
    out = tmp_path / "c.json"
    _run(["chunked", "--small", "--model", "llama3-8b", "--device", "cpu", "--long-len", "256",
          "--budgets", "128", "--thresholds", "64", "--pairs", "48:96", "--reps", "1",
          "--json", str(out)])
    report = json.loads(out.read_text())
    assert (report["model"]["name"], report["model"]["model_type"]) == (
        "llama3-8b (small)", "llama")
    assert report["complete"] is True
    labels = [r["label"] for r in report["configs"]]
    assert labels == ["no chunking", "thr=64 (mnbt=512)", "thr=48, mnbt=96", "mnbt=128"]
    assert all(r["unfinished"] == 0 for r in report["configs"])
    pair = report["configs"][2]
    assert pair["engine_config"]["long_prefill_token_threshold"] == 48
    assert pair["max_step_tokens_last_rep"] <= 96 < report["configs"][0][
        "max_step_tokens_last_rep"]


def test_bad_model_choice_is_rejected() -> None:
    result = CliRunner().invoke(bench, ["prefix", "--small", "--model", "gpt2"])
    assert result.exit_code != 0
    assert "llama3-8b" in result.output


def test_pairs_are_parsed_and_checked() -> None:
    import click

    from pagedcore.bench.chunked import parse_pairs

    assert parse_pairs("768:1024, 1536:2048") == [(768, 1024), (1536, 2048)]
    assert parse_pairs(None) == []
    for bad in ("768", "a:b", "2048:1024", "0:16", "1:2:3"):
        with pytest.raises(click.BadParameter):
            parse_pairs(bad)


def test_model_option_reaches_the_memory_bench(tmp_path: Path) -> None:
    """The 8B shape's KV is 128 KiB per token (32 layers x 2 x 8 heads x 128 x 2 bytes), so
    1 GiB holds 8,192 slots = 512 blocks; the 0.5B shape's 12 KiB per token 87,381 slots."""
    kernel = tmp_path / "k.json"
    kernel.write_text(json.dumps({"results": [
        {"backend": "fake", "block_size": 16, "kv_GBps": 1.0, "shape": "1x1"}]}))
    blocks = {}
    for name in ("llama3-8b", "qwen2-0.5b"):
        out = tmp_path / f"{name}.json"
        _run(["memory", "--model", name, "--budget-mib", "1024", "--kernel-json", str(kernel),
              "--json", str(out)])
        report = json.loads(out.read_text())
        assert report["model"]["name"] == name
        blocks[name] = report["paged"]["num_blocks"]
    assert blocks["llama3-8b"] == 512
    assert blocks["qwen2-0.5b"] == (1 << 30) // (12 * 1024 * 16)
