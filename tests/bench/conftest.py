"""Fixtures of the experiment-bench tests: a tiny engine on CPU, one intra-op thread."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_model() -> Any:
    from pagedcore.engine.models.loading import random_model, tiny_config

    config = tiny_config("qwen2", vocab_size=128, max_position_embeddings=1024)
    return random_model(config, dtype=torch.float32, device=torch.device("cpu"), seed=0)


@pytest.fixture
def make_llm(tiny_model: Any) -> Callable[..., Any]:
    """``make_llm(**engine_kwargs)``: a fresh CPU engine over a copy of the tiny model."""
    import copy

    from pagedcore.engine.llm import LLM

    def make(**kw: Any) -> Any:
        kw.setdefault("max_model_len", 512)
        kw.setdefault("block_size", 16)
        kw.setdefault("kv_cache_memory_bytes", 8 << 20)
        return LLM(copy.deepcopy(tiny_model), device="cpu", dtype=torch.float32, **kw)

    return make
