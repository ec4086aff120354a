"""Builds paged batches for the flash_attn adapter tests, and the dense float64 oracle.

The oracle is written in pagedcore's coordinates (absolute positions, the semantics in
``pagedcore/attention/backend.py``) from the unpaged K/V, independent of the test double.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedcore.attention.metadata import CommonAttentionMetadata


@dataclass
class PagedBatch:
    """A step: requests with cached history plus new tokens, in a NaN-poisoned paged cache."""

    query: torch.Tensor  # [T, Hq, D]
    key: torch.Tensor  # [T, Hkv, D], this step's K (padding rows hold junk)
    value: torch.Tensor
    kv_cache: torch.Tensor  # [2, N, B, Hkv, D]; history written, everything else NaN
    full_k: list[torch.Tensor]  # per request [seq_len, Hkv, D]
    full_v: list[torch.Tensor]
    context_lens: list[int]
    query_lens: list[int]
    common: CommonAttentionMetadata


def make_batch(
    requests: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int = 64,
    block_size: int = 256,
    pad_tokens: int = 0,
    spare_blocks: int = 3,
    extra_table_columns: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> PagedBatch:
    """`requests` is a list of ``(context_len, query_len)``; physical blocks are shuffled."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in requests]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = 1 + sum(blocks_per_req) + spare_blocks  # block 0 is the null block
    physical = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    width = max(blocks_per_req) + extra_table_columns
    block_table = torch.zeros(len(requests), width, dtype=torch.int32)
    cursor = 0
    for r, n in enumerate(blocks_per_req):
        block_table[r, :n] = torch.tensor(physical[cursor : cursor + n], dtype=torch.int32)
        cursor += n

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    kv_cache = torch.full(
        (2, num_blocks, block_size, num_kv_heads, head_size), float("nan"), dtype=dtype
    )
    full_k = [randn(s, num_kv_heads, head_size) for s in seq_lens]
    full_v = [randn(s, num_kv_heads, head_size) for s in seq_lens]

    def slot(r: int, pos: int) -> int:
        return int(block_table[r, pos // block_size]) * block_size + pos % block_size

    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_size)
    keys, values, slots, positions = [], [], [], []
    for r, (ctx, q_len) in enumerate(requests):
        for pos in range(ctx):
            flat[0, slot(r, pos)] = full_k[r][pos]
            flat[1, slot(r, pos)] = full_v[r][pos]
        keys.append(full_k[r][ctx:])
        values.append(full_v[r][ctx:])
        slots += [slot(r, p) for p in range(ctx, ctx + q_len)]
        positions += list(range(ctx, ctx + q_len))
    num_actual = len(slots)
    keys.append(randn(pad_tokens, num_kv_heads, head_size))
    values.append(randn(pad_tokens, num_kv_heads, head_size))
    slots += [-1] * pad_tokens
    positions += [0] * pad_tokens
    query_lens = [q for _, q in requests]
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=seq,
        seq_lens_cpu=seq.clone(),
        num_reqs=len(requests),
        num_actual_tokens=num_actual,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_table=block_table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        causal=True,
    )
    return PagedBatch(
        query=randn(num_actual + pad_tokens, num_heads, head_size),
        key=torch.cat(keys),
        value=torch.cat(values),
        kv_cache=kv_cache,
        full_k=full_k,
        full_v=full_v,
        context_lens=[c for c, _ in requests],
        query_lens=query_lens,
        common=common,
    )


def dense_oracle(
    batch: PagedBatch,
    *,
    scale: float,
    sliding_window: int | None = None,
    alibi_slopes: list[float] | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """``[num_actual_tokens, Hq, D]`` float64 attention in pagedcore's documented semantics."""
    num_heads = batch.query.shape[1]
    outs = []
    start = 0
    for r, (ctx, q_len) in enumerate(zip(batch.context_lens, batch.query_lens, strict=True)):
        q = batch.query[start : start + q_len].double()
        start += q_len
        group = num_heads // batch.full_k[r].shape[1]
        k = batch.full_k[r].double().repeat_interleave(group, dim=1)
        v = batch.full_v[r].double().repeat_interleave(group, dim=1)
        pos_q = torch.arange(ctx, ctx + q_len)[:, None]
        pos_k = torch.arange(ctx + q_len)[None, :]
        s = scale * torch.einsum("ihd,jhd->hij", q, k)
        if soft_cap is not None:
            s = soft_cap * torch.tanh(s / soft_cap)
        if alibi_slopes is not None:
            slopes = torch.tensor(alibi_slopes, dtype=torch.float64)[:, None, None]
            s = s + slopes * (pos_k - pos_q)[None]
        visible = pos_k <= pos_q
        if sliding_window is not None:
            visible &= pos_q - pos_k < sliding_window
        s = s.masked_fill(~visible[None], float("-inf"))
        outs.append(torch.einsum("hij,jhd->ihd", torch.softmax(s, dim=-1), v))
    return torch.cat(outs)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max|a - e| / max|e|`` in float64 (NaN when `actual` holds NaN)."""
    diff = (actual.double() - expected.double()).abs().max()
    return float(diff / expected.double().abs().max().clamp_min(1e-12))
