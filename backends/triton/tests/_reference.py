"""A float64 torch formula of paged attention and a random paged batch, for the tests."""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import torch

from pagedcore.attention import CommonAttentionMetadata


@attrs.frozen(kw_only=True)
class PagedBatch:
    """A random step: history already in a NaN-poisoned cache, new K/V to write."""

    query: torch.Tensor  # [T, Hq, D]
    key: torch.Tensor  # [T, Hkv, D] new tokens
    value: torch.Tensor
    kv_cache: torch.Tensor  # [2, N, B, Hkv, D]
    common: CommonAttentionMetadata
    hist_k: list[torch.Tensor]  # per request [ctx, Hkv, D]
    hist_v: list[torch.Tensor]
    q_lens: list[int]
    seq_lens: list[int]


def make_batch(
    reqs: Sequence[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    extra_blocks: int = 3,
    num_padding: int = 0,
    seed: int = 0,
) -> PagedBatch:
    """`reqs` is ``[(context_len, query_len)]``; blocks are randomly permuted, block 0 is null."""
    g = torch.Generator().manual_seed(seed)
    blocks_per = [math.ceil((c + q) / block_size) for c, q in reqs]
    num_blocks = 1 + sum(blocks_per) + extra_blocks
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    cache = torch.full(
        (2, num_blocks, block_size, num_kv_heads, head_size), float("nan"), dtype=dtype
    )
    max_blocks = max(blocks_per) + 1
    table = torch.zeros((len(reqs), max_blocks), dtype=torch.int32)
    qs, ks, vs, slots, positions, hist_k, hist_v = [], [], [], [], [], [], []
    cursor = 0
    for r, (ctx, q) in enumerate(reqs):
        ids = perm[cursor : cursor + blocks_per[r]]
        cursor += blocks_per[r]
        table[r, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        k_all = torch.randn((ctx + q, num_kv_heads, head_size), generator=g).to(dtype)
        v_all = torch.randn((ctx + q, num_kv_heads, head_size), generator=g).to(dtype)
        pos = torch.arange(ctx + q)
        slot = torch.tensor(ids)[pos // block_size] * block_size + pos % block_size
        flat = cache.view(2, -1, num_kv_heads, head_size)
        flat[0, slot[:ctx]] = k_all[:ctx]
        flat[1, slot[:ctx]] = v_all[:ctx]
        hist_k.append(k_all)
        hist_v.append(v_all)
        ks.append(k_all[ctx:])
        vs.append(v_all[ctx:])
        qs.append(torch.randn((q, num_heads, head_size), generator=g).to(dtype))
        slots.append(slot[ctx:])
        positions.append(pos[ctx:])
    for _ in range(num_padding):
        ks.append(torch.randn((1, num_kv_heads, head_size), generator=g).to(dtype))
        vs.append(torch.randn((1, num_kv_heads, head_size), generator=g).to(dtype))
        qs.append(torch.randn((1, num_heads, head_size), generator=g).to(dtype))
        slots.append(torch.tensor([-1]))
        positions.append(torch.tensor([0]))
    q_lens = [q for _, q in reqs]
    seq_lens = [c + q for c, q in reqs]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl.to(device),
        query_start_loc_cpu=qsl,
        seq_lens=lens.to(device),
        seq_lens_cpu=lens,
        num_reqs=len(reqs),
        num_actual_tokens=sum(q_lens),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_table=table.to(device),
        slot_mapping=torch.cat(slots).to(torch.int64).to(device),
        positions=torch.cat(positions).to(torch.int64).to(device),
    )
    return PagedBatch(
        query=torch.cat(qs).to(device),
        key=torch.cat(ks).to(device),
        value=torch.cat(vs).to(device),
        kv_cache=cache.to(device),
        common=common,
        hist_k=hist_k,
        hist_v=hist_v,
        q_lens=q_lens,
        seq_lens=seq_lens,
    )


def reference_attention(
    batch: PagedBatch,
    *,
    scale: float,
    alibi_slopes: Sequence[float] | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """``[num_actual_tokens, Hq, D]`` float64 attention from the un-paged K/V."""
    outs = []
    start = 0
    num_heads = batch.query.shape[1]
    for r, q_len in enumerate(batch.q_lens):
        seq_len = batch.seq_lens[r]
        q = batch.query[start : start + q_len].double().cpu()
        start += q_len
        k = batch.hist_k[r].double()
        v = batch.hist_v[r].double()
        qpk = num_heads // k.shape[1]
        k = k.repeat_interleave(qpk, dim=1)
        v = v.repeat_interleave(qpk, dim=1)
        s = torch.einsum("qhd,khd->hqk", q, k) * scale
        if logits_soft_cap is not None:
            s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
        pos_q = torch.arange(seq_len - q_len, seq_len)[:, None]
        pos_k = torch.arange(seq_len)[None, :]
        if alibi_slopes is not None:
            slopes = torch.tensor(alibi_slopes, dtype=torch.float64)[:, None, None]
            s = s + slopes * (pos_k - pos_q).double()
        visible = torch.ones((q_len, seq_len), dtype=torch.bool)
        if causal:
            visible &= pos_k <= pos_q
        if sliding_window is not None:
            visible &= pos_q - pos_k < sliding_window
        s = s.masked_fill(~visible, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v))
    return torch.cat(outs)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64 (NaN in `out` gives NaN)."""
    out64 = out.double().cpu()
    return float((out64 - ref).norm() / ref.norm())
