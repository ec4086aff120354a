"""Plain torch building blocks of the reference backend: cache writes, gathers, masked attention.

Functions, not classes, so that other reference implementations (an MLA impl, tests, tools) can
reuse them. Everything computes in float32.
"""

from __future__ import annotations

import torch

__all__ = ["attend", "gather_slots", "write_slots"]


def write_slots(cache: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter one token vector per slot into one half (K or V) of a paged cache.

    Parameters
    ----------
    cache:
        ``[num_blocks, block_size, H, D]`` (any float dtype), contiguous; written in place.
    values:
        ``[T, H, D]``; cast to ``cache.dtype``.
    slot_mapping:
        ``[T]`` integer; ``slot = block_id * block_size + offset``; entries ``< 0`` are padding
        and are skipped.
    """
    flat = cache.view(-1, *cache.shape[2:])
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].to(torch.int64)
    rows = values[keep].to(cache.dtype)
    if cache.dtype.itemsize == 1:  # fp8: torch has no index_copy_ for it on every device
        flat, rows = flat.view(torch.uint8), rows.view(torch.uint8)
    flat.index_copy_(0, slots, rows)


def gather_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Read token vectors from one half (K or V) of a paged cache, as float32.

    Parameters
    ----------
    cache:
        ``[num_blocks, block_size, H, D]``, contiguous.
    slots:
        ``[N, L]`` int64 flat slot ids (all in range).

    Returns
    -------
    torch.Tensor
        ``[N, L, H, D]`` float32.
    """
    flat = cache.view(-1, *cache.shape[2:])
    if cache.dtype.itemsize == 1:  # fp8: gather the bytes, then reinterpret
        rows = flat.view(torch.uint8).index_select(0, slots.reshape(-1)).view(cache.dtype)
    else:
        rows = flat.index_select(0, slots.reshape(-1))
    out = rows.to(torch.float32)
    return out.view(*slots.shape, *cache.shape[2:])


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    causal: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    overwrite_kv: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Masked attention of ``N`` requests that share a query length ``Lq``.

    Query ``i`` of request ``n`` sits at position ``seq_lens[n] - Lq + i``; key ``j`` at
    position ``j``. Keys at ``j >= seq_lens[n]`` are padding. Key/value rows no query of the
    request can see are zeroed before use, so NaN or garbage there never reaches the output.

    Parameters
    ----------
    query:
        ``[N, Lq, Hq, D]`` float32.
    key, value:
        ``[N, Lk, Hkv, D]`` float32; ``Hq % Hkv == 0``, query head ``h`` reads KV head
        ``h // (Hq // Hkv)``.
    seq_lens:
        ``[N]`` int64, ``Lq <= seq_lens[n] <= Lk``.
    scale:
        Multiplies ``q·k``.
    causal:
        Mask keys after the query's position.
    alibi_slopes:
        ``[Hq]`` float32, adds ``slope_h * (pos_k - pos_q)``; or None.
    sliding_window:
        ``W``: a key is visible iff ``pos_q - pos_k < W``; or None.
    logits_soft_cap:
        ``c``: scores become ``c * tanh(s / c)`` before the ALiBi bias; or None.
    overwrite_kv:
        Zero the invisible rows of `key` and `value` in place instead of copying them (for
        callers that own those tensors, e.g. fresh gathers).
    sinks:
        ``[Hq]`` float32 attention-sink logits: each joins its head's softmax denominator
        (unscaled, never masked) and contributes no value; or None.

    Returns
    -------
    torch.Tensor
        ``[N, Lq, Hq, D]`` float32.
    """
    n, lq, hq, d = query.shape
    lk, hkv = key.shape[1], key.shape[2]
    group = hq // hkv
    device = query.device

    q_pos = seq_lens[:, None] - lq + torch.arange(lq, device=device)  # [N, Lq]
    k_pos = torch.arange(lk, device=device)  # [Lk]
    visible = k_pos[None, None, :] < seq_lens[:, None, None]  # [N, 1, Lk]
    rel = q_pos[:, :, None] - k_pos[None, None, :]  # [N, Lq, Lk] = pos_q - pos_k
    if causal:
        visible = visible & (rel >= 0)
    if sliding_window is not None:
        visible = visible & (rel < sliding_window)
    visible = visible.expand(n, lq, lk)
    unused = ~visible.any(dim=1)[:, :, None, None]  # [N, Lk, 1, 1]
    if overwrite_kv:
        key.masked_fill_(unused, 0.0)
        value.masked_fill_(unused, 0.0)
    else:
        key = key.masked_fill(unused, 0.0)
        value = value.masked_fill(unused, 0.0)

    # [N, Hkv, G*Lq, D] @ [N, Hkv, D, Lk]: one batched matmul per request group.
    q = (query * scale).view(n, lq, hkv, group, d).permute(0, 2, 3, 1, 4)
    q = q.reshape(n, hkv, group * lq, d)
    scores = torch.matmul(q, key.permute(0, 2, 3, 1)).view(n, hkv, group, lq, lk)
    if logits_soft_cap is not None:
        scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(device=device, dtype=torch.float32).view(1, hkv, group, 1, 1)
        scores = scores - slopes * rel[:, None, None].to(torch.float32)
    bias = torch.zeros(n, 1, 1, lq, lk, device=device).masked_fill_(
        ~visible[:, None, None], float("-inf")
    )
    scores = scores.add_(bias)
    if sinks is not None:
        sink = sinks.to(device=device, dtype=torch.float32).view(1, hkv, group, 1, 1)
        scores = torch.cat([scores, sink.expand(n, hkv, group, lq, 1)], dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., :lk].reshape(n, hkv, group * lq, lk)
    else:
        probs = torch.softmax(scores, dim=-1).view(n, hkv, group * lq, lk)
    out = torch.matmul(probs, value.permute(0, 2, 1, 3))  # [N, Hkv, G*Lq, D]
    return out.view(n, hkv, group, lq, d).permute(0, 3, 1, 2, 4).reshape(n, lq, hq, d)
