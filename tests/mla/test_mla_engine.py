"""DeepSeek-V2/V3-shaped models through the engine: greedy tokens identical to transformers'
generate() in float32 on CPU (logits compared as log-probabilities), with chunked prefill,
prefix caching and forced preemption; the paged cache holds only the latent rows."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from mla_helpers import seeded_model, tiny_deepseek_config

from pagedcore import LLM, SamplingParams
from pagedcore.engine.models.mla_attention import PagedMLAAttention
from pagedcore.kv_cache.spec import MLAAttentionSpec

MAX_NEW = 16


def _hf_greedy(model: Any, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False,
                         eos_token_id=None, pad_token_id=0, output_logits=True,
                         return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, torch.stack([x[0] for x in out.logits]).float().log_softmax(-1)


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in lengths]


def _check(ref: Any, prompts: list[list[int]], outs: list[Any]) -> None:
    for prompt, out in zip(prompts, outs, strict=True):
        tokens, logprobs = _hf_greedy(ref, prompt)
        got = out.outputs[0]
        assert got.token_ids == tokens, f"prompt of {len(prompt)} tokens diverged"
        for step, entry in enumerate(got.logprobs):
            for token, value in entry.items():
                want = float(logprobs[step, token])
                assert abs(value - want) < 1e-4 * max(1.0, abs(want)), (step, token, value, want)


def _llm(model: Any, *, budget_blocks: int | None, **kwargs: Any) -> LLM:
    spec = MLAAttentionSpec(block_size=4, kv_lora_rank=32, rope_head_dim=8, dtype="float32")
    budget = 1 << 20 if budget_blocks is None else 2 * spec.page_size_bytes * budget_blocks
    return LLM(model, device="cpu", block_size=4, max_model_len=64, max_num_batched_tokens=24,
               long_prefill_token_threshold=12, kv_cache_memory_bytes=budget,
               backend="reference_mla", **kwargs)


PARAMS = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, logprobs=2)


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3"])
def test_mla_engine_matches_generate(model_type: str) -> None:
    """Chunked prefill (threshold 12, budget 24), prefix hits and forced preemptions at once."""
    config = tiny_deepseek_config(model_type)
    ref = seeded_model(config, seed=0)
    eng = seeded_model(config, seed=0)
    # Room for ~2.5 requests of up to 46 tokens: the later prompts force preemptions.
    llm = _llm(eng, budget_blocks=1 + 16 + 24)
    assert llm.runner.backend_names == ["reference_mla"]
    assert all(isinstance(m.self_attn, PagedMLAAttention) for m in eng.model.layers)
    cache = next(iter(llm.runner.kv_caches.values()))
    assert tuple(cache.shape[1:]) == (4, 40), "the cache holds one latent row per token"
    prefix = _prompts([18], seed=7)[0]
    first = llm.generate([[*prefix, 5]], PARAMS)
    prompts = [prefix + s for s in _prompts([3, 9], seed=8)] + _prompts([25, 7, 30, 14], seed=3)
    outs = llm.generate(prompts, PARAMS)
    assert [o.num_cached_tokens for o in outs[:2]] == [16, 16]
    assert llm.stats()["preemptions"] >= 1, llm.stats()
    _check(ref, [[*prefix, 5], *prompts], first + outs)


def test_triton_mla_through_engine() -> None:
    """The Triton MLA backend serves the engine too: float32 on a GPU when there is one (the
    reference stays on the CPU), else in the interpreter (short run)."""
    pytest.importorskip("pagedcore_triton.mla")
    from pagedcore.plugins.registry import get_registry

    if "triton_mla" not in get_registry().backends:
        pytest.skip("pagedcore-triton is not installed with triton_mla registered")
    from pagedcore_triton.mla import TritonMLABackend

    if "cpu" not in TritonMLABackend.supported_devices and not torch.cuda.is_available():
        pytest.skip("pagedcore_triton was imported before TRITON_INTERPRET=1 was set")
    config = tiny_deepseek_config()
    ref = seeded_model(config, seed=1)
    eng = seeded_model(copy.deepcopy(config), seed=1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(eng, device=device, dtype=torch.float32, block_size=16, max_model_len=64,
              max_num_batched_tokens=16, kv_cache_memory_bytes=1 << 20, backend="triton_mla")
    prompts = _prompts([20, 5], seed=4)
    _check(ref, prompts, llm.generate(prompts, PARAMS))
