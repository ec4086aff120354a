"""Issue #25 item 5: a Hugging Face model id resolves from the local cache (a fake HF cache
built here; the hub is never contacted: HF_HUB_OFFLINE)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedcore import LLM
from pagedcore.engine.models.hub import ModelNotFoundError, looks_like_repo_id


@pytest.fixture()
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A hub cache holding ``tiny-org/tiny-llama`` at revision main, and offline mode."""
    from huggingface_hub import constants
    from transformers import AutoModelForCausalLM

    from pagedcore.engine.models.loading import tiny_config

    cache = tmp_path / "hub"
    repo = cache / "models--tiny-org--tiny-llama"
    snapshot = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snapshot.name)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_model_id_loads_from_the_cache(hf_cache: Path) -> None:
    llm = LLM("tiny-org/tiny-llama", device="cpu", max_model_len=32,
              kv_cache_memory_bytes=1 << 20)
    assert llm.model_name == "tiny-org/tiny-llama"
    assert llm.model.config.model_type == "llama"
    out = llm.generate([[3, 4, 5]], None)
    assert len(out[0].outputs[0].token_ids) > 0


def test_unknown_id_names_the_cache_and_offline_mode(hf_cache: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="HF_HUB_OFFLINE") as info:
        LLM("tiny-org/no-such-model", device="cpu")
    assert str(hf_cache) in str(info.value)


def test_paths_are_not_model_ids() -> None:
    assert looks_like_repo_id("Qwen/Qwen2-0.5B") and looks_like_repo_id("gpt2")
    for path in ("./ckpt", "/tmp/ckpt", "a/b/c", "../x", "dir/"):
        assert not looks_like_repo_id(path), path
