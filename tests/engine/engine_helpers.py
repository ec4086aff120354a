"""Helpers for the engine tests: tiny seeded models and transformers' own greedy output."""

from __future__ import annotations

import copy
from typing import Any

import torch

from pagedcore.engine.models.loading import random_model, tiny_config

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma2"]
CPU = torch.device("cpu")


def make_models(arch: str, seed: int = 0, **overrides: Any) -> tuple[Any, Any, Any]:
    """(config, transformers reference model with eager attention, engine copy), same weights."""
    config = tiny_config(arch, **overrides)
    ref = random_model(copy.deepcopy(config), dtype=torch.float32, device=CPU, seed=seed)
    ref.set_attn_implementation("eager")
    eng = random_model(copy.deepcopy(config), dtype=torch.float32, device=CPU, seed=seed)
    return config, ref, eng


def hf_greedy(model: Any, prompt: list[int], max_new: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and the ``[max_new, V]`` log-softmax of each step's logits."""
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = torch.stack([x[0] for x in out.logits]).float().log_softmax(-1)
    return tokens, logprobs


def check_outputs_against_hf(ref: Any, prompts: list[list[int]], outs: list[Any],
                             max_new: int) -> None:
    """Each output's greedy tokens equal transformers' and its logprobs are within 1e-4."""
    for prompt, out in zip(prompts, outs, strict=True):
        tokens, logprobs = hf_greedy(ref, prompt, max_new)
        got = out.outputs[0]
        assert got.token_ids == tokens, f"prompt of {len(prompt)} tokens diverged"
        assert got.logprobs is not None
        for step, entry in enumerate(got.logprobs):
            for token, value in entry.items():
                expected = float(logprobs[step, token])
                assert abs(value - expected) < 1e-4 * max(1.0, abs(expected)), (
                    f"step {step} token {token}: logprob {value} vs transformers {expected}"
                )


def random_prompts(lengths: list[int], *, vocab: int = 128, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def assert_no_leak(llm: Any) -> None:
    """Every block is back in the free queue and every ref count is zero."""
    kv = llm.kv_cache_manager
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_total_blocks == llm.kv_cache_config.num_blocks - 1
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks[1:])
    assert not llm.scheduler.running and not llm.scheduler.waiting
    # Nothing of a finished request stays referenced by the engine's bookkeeping.
    assert not getattr(llm, "_prompt_pending", None), llm._prompt_pending
    assert not getattr(llm, "_processing_ids", None), llm._processing_ids
