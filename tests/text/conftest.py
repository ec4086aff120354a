"""Fixtures of the text tests: a tiny chat checkpoint with a trained BPE tokenizer and two
EOS ids, and an engine over it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from device_helpers import TEST_BACKEND, TEST_DEVICE, require_test_device
from thread_helpers import one_thread
from tokenizer_helpers import make_chat_checkpoint

from pagedcore.engine.llm import LLM

_one_thread = pytest.fixture(scope="session", autouse=True)(one_thread)


@pytest.fixture(scope="session")
def multi_eos_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_checkpoint(tmp_path_factory.mktemp("multi-eos"), multi_eos=True)


@pytest.fixture(scope="session")
def llm(multi_eos_checkpoint: Path) -> LLM:
    require_test_device()
    return LLM(str(multi_eos_checkpoint), device=TEST_DEVICE, dtype="float32",
               backend=TEST_BACKEND, max_model_len=128, kv_cache_memory_bytes=8 * 2**20)


@pytest.fixture(scope="session")
def hf_model(multi_eos_checkpoint: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(multi_eos_checkpoint),
                                                 torch_dtype=torch.float32)
    model.set_attn_implementation("eager")
    return model.to(TEST_DEVICE).eval()
