"""Tiny DeepSeek-V2/V3-shaped models and a dense `StepContext` for the MLA tests."""

from __future__ import annotations

import copy
from typing import Any

import torch

from pagedcore.attention.metadata import CommonAttentionMetadata

CPU = torch.device("cpu")


def tiny_deepseek_config(model_type: str = "deepseek_v2", **overrides: Any) -> Any:
    """The engine's tiny DeepSeek config: 2 layers (dense + small MoE), 4 heads, latent 32 +
    rope 8, nope 16, v 12, initializer_range 0.1."""
    from pagedcore.engine.models.loading import tiny_config

    return tiny_config(model_type, **overrides)


def seeded_model(config: Any, *, seed: int = 0) -> Any:
    """A float32 CPU causal LM with seeded random weights, eager attention."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32)
    model.set_attn_implementation("eager")
    return model.eval()


def dense_common(
    query_lens: list[int], seq_lens: list[int], *, block_size: int, num_blocks: int,
    gen: torch.Generator,
) -> CommonAttentionMetadata:
    """Metadata for a batch over randomly permuted physical blocks (block 0 unused)."""
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    nblk = [-(-s // block_size) for s in seq_lens]
    table = torch.zeros(len(seq_lens), max(nblk), dtype=torch.int32)
    used = 0
    for r, n in enumerate(nblk):
        table[r, :n] = torch.tensor(perm[used : used + n], dtype=torch.int32)
        used += n
    slots, positions = [], []
    for r, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
        for pos in range(s - q, s):
            slots.append(int(table[r, pos // block_size]) * block_size + pos % block_size)
            positions.append(pos)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=sl, seq_lens_cpu=sl,
        num_reqs=len(seq_lens), num_actual_tokens=sum(query_lens),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), block_table=table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
    )
