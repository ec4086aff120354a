"""The engine end to end through the adapter and the FlashInfer test double, on the CPU: greedy
tokens equal the reference backend's over chunked prefills, decodes and mixed steps."""

from __future__ import annotations

import types
from collections.abc import Sequence

import fi_double
import pytest
import torch
from pagedcore_flashinfer import fi_api
from test_flashinfer_conformance import _CpuDoubleBackend

import pagedcore
from pagedcore import LLM, AttentionBackend, SamplingParams
from pagedcore.engine.models.loading import random_model, tiny_config
from pagedcore.plugins.registry import BackendRegistry, isolated_registry
from pagedcore.reference import plugin as reference_plugin


@pagedcore.hookimpl
def _register() -> Sequence[type[AttentionBackend]]:
    return [_CpuDoubleBackend]


def test_greedy_tokens_match_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fi_api, "load_flashinfer", lambda: fi_double.FakeFlashInfer())
    fi_double.REGISTRY.clear()
    registry = BackendRegistry()
    registry.register_plugin(reference_plugin, name="reference")
    registry.register_plugin(
        types.SimpleNamespace(pagedcore_register_backends=_register), name="double"
    )
    config = tiny_config("llama", head_dim=64, hidden_size=128)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (9, 30, 3)]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    tokens = {}
    with isolated_registry(registry):
        for name in ("reference", _CpuDoubleBackend.name):
            model = random_model(config, dtype=torch.float32, device=torch.device("cpu"), seed=0)
            llm = LLM(model, device="cpu", dtype="float16", block_size=16, max_model_len=64,
                      max_num_batched_tokens=24, backend=name, kv_cache_memory_bytes=1 << 20)
            tokens[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert tokens[_CpuDoubleBackend.name] == tokens["reference"]
    kinds = {w.kind for w in fi_double.REGISTRY if w.runs}
    assert kinds == {"decode", "prefill"}, kinds
