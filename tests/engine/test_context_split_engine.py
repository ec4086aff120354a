"""Warm prefix hits over the triton backend take the context split (issue 22): the engine's
tokens and logprobs still equal transformers'.

A prefill part whose context holds at least 4x its query (a prefix hit's remainder) splits
its context across programs (`pagedcore_triton.plan.context_segments`); the kernel tests check
the split against a formula, this checks it through the engine (the builder's parts, the
impl's first-layer decision reused by the next layer, prefix caching). Runs in Triton's
interpreter on the CPU (~30 s), on real kernels on a GPU.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import
if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton", allow_module_level=True)

from engine_helpers import check_outputs_against_hf, make_models, random_prompts

from pagedcore import LLM, SamplingParams


def test_prefix_hits_split_their_context_and_match_transformers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pagedcore_triton.impl import TritonAttentionImpl

    splits: list[int] = []
    resolve = TritonAttentionImpl._context_split

    def spy(self: Any, *args: Any) -> Any:
        part = resolve(self, *args)
        splits.append(part.num_segments)
        return part

    monkeypatch.setattr(TritonAttentionImpl, "_context_split", spy)
    _config, ref, eng = make_models("llama", head_dim=64, max_position_embeddings=1024)
    prefix = random_prompts([400], seed=3)[0]
    prompts = [prefix + random_prompts([n], seed=10 + n)[0] for n in (8, 5)]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(eng.to(device), device=device, backend="triton", block_size=16, max_model_len=512,
              max_num_batched_tokens=1024, kv_cache_memory_bytes=16 << 20,
              enable_prefix_caching=True, dtype="float32", enforce_eager=True)
    params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=5)
    first = llm.generate(prompts[:1], params)
    rest = llm.generate(prompts[1:], params)
    assert [o.num_cached_tokens for o in rest] == [400]  # whole blocks of the prefix
    assert splits and max(splits) > 1, splits  # the hits' remainders ran split
    check_outputs_against_hf(ref, prompts, first + rest, 3)
