"""Cascade attention for shared prefixes: what is shared, when it pays, and the LSE merge.

When every request of a step holds its first ``P`` tokens in the *same physical blocks* (a
shared system prompt, the ``n`` samples of one prompt), a backend that declares
``supports_cascade`` attends those ``P`` tokens once for all queries of the step, attends
each request's own suffix as usual, and merges the two partial softmax states by their
log-sum-exp (`merge_attention_states`). Every query of the step sits after the prefix
(``P`` is at most the smallest context length), so the prefix needs no causal mask.

The engine computes ``P`` per KV-cache group and step (`common_prefix_len`), records it in
`CommonAttentionMetadata.common_prefix_len`, and passes it to `MetadataBuilder.build` only
when the backend declares cascade and `cascade_pays`; otherwise it passes 0.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence, Sized
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = [
    "CASCADE_ENV",
    "CASCADE_GRAPH_LOSS_BYTES_PER_LAYER",
    "CASCADE_MIN_REQUESTS",
    "CASCADE_MIN_SAVED_TOKENS",
    "cascade_beats_graph",
    "cascade_mode",
    "cascade_pays",
    "check_common_prefix_len",
    "common_prefix_len",
    "merge_attention_states",
]

#: ``PAGEDCORE_CASCADE``: ``auto`` (default: `cascade_pays` decides), ``off`` (never) or
#: ``always`` (whenever something is shared; for tests and benchmarks).
CASCADE_ENV = "PAGEDCORE_CASCADE"
_MODES = ("auto", "off", "always")

#: Fewest requests for which cascade is considered (one request alone has nothing to share).
CASCADE_MIN_REQUESTS = 2
#: Cascade pays when it saves at least this many KV-token reads per layer,
#: ``common_prefix_len * (num_reqs - 1)``. It costs two extra launches per layer (prefix and
#: merge, ~5-10 us each on an H200), and a token of KV at 8 KV heads x 128 x bf16 is 4 KiB,
#: read at ~4.5 TB/s: 16K tokens ~ 15 us. ``docs/benchmarks/run_cascade_h200.sh`` measures
#: the break-even over a grid of (prefix, requests) and ``docs/engine.md`` reports it.
CASCADE_MIN_SAVED_TOKENS = 16384


def cascade_mode() -> str:
    """``PAGEDCORE_CASCADE`` (``auto`` when unset); a ValueError names the allowed values."""
    mode = os.environ.get(CASCADE_ENV, "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise ValueError(
            f"{CASCADE_ENV}={mode!r} is not one of {', '.join(_MODES)}; unset it or pick one"
        )
    return mode


def common_prefix_len(
    block_tables: Iterable[Sequence[int]], context_lens: Sequence[int], block_size: int
) -> int:
    """Leading tokens every request holds in the same physical blocks.

    Parameters
    ----------
    block_tables:
        One list of physical block ids per request of the step (an iterable: read only
        while some prefix is still shared, so a lazy one skips the rest once none is).
    context_lens:
        Tokens already in the cache before this step, per request (the first query position).
    block_size:
        Tokens per block.

    Returns
    -------
    int
        A multiple of `block_size`: the full leading blocks shared by all requests, capped at
        the smallest context length rounded down to a block (so every query of the step lies
        after the prefix and a prefix that ends mid-block is cascaded over its full blocks
        only). 0 with fewer than `CASCADE_MIN_REQUESTS` requests.
    """
    count = len(block_tables) if isinstance(block_tables, Sized) else len(context_lens)
    if count < CASCADE_MIN_REQUESTS:
        return 0
    tables = iter(block_tables)
    first = next(tables)
    limit = min(min(context_lens) // block_size, len(first))
    head = list(first[:limit])
    for table in tables:
        if limit == 0:
            break
        if list(table[:limit]) == head:  # the common case, compared at C speed
            continue
        n = min(limit, len(table))
        i = 0
        while i < n and table[i] == head[i]:
            i += 1
        limit = i
        head = head[:limit]
    return limit * block_size


def cascade_pays(
    prefix_len: int, num_reqs: int, *, min_saved_tokens: int = CASCADE_MIN_SAVED_TOKENS
) -> bool:
    """The measured rule: cascade when it saves ``prefix_len * (num_reqs - 1)`` KV-token
    reads of at least `min_saved_tokens` per layer (see `CASCADE_MIN_SAVED_TOKENS`)."""
    if prefix_len <= 0 or num_reqs < CASCADE_MIN_REQUESTS:
        return False
    return prefix_len * (num_reqs - 1) >= min_saved_tokens


#: What a step that cascades gives up when a CUDA graph would otherwise serve it (a cascade
#: plan follows the step's lengths, so such a step runs eagerly): the eager forward's
#: launches and Python, ~0.5 ms per decoder layer on the H200 (Qwen2-0.5B shape, fused
#: kernels: a 13.3 ms eager one-token forward against a ~1.5 ms graph step over 24 layers,
#: ``docs/benchmarks/step_h200_r1/``), counted as the KV bytes read in that time at the copy
#: bandwidth (~4.3 TB/s): ~2 GB per layer.
CASCADE_GRAPH_LOSS_BYTES_PER_LAYER = 2_000_000_000


def cascade_beats_graph(prefix_len: int, num_reqs: int, kv_bytes_per_token: int, *,
                        loss_bytes: int | None = None) -> bool:
    """Whether cascading a step that a CUDA graph would otherwise serve still pays: the KV
    bytes per layer it saves, ``prefix_len * (num_reqs - 1) * kv_bytes_per_token`` (K and V
    of one layer's KV heads per token), reach what the eager step costs in reads
    (`CASCADE_GRAPH_LOSS_BYTES_PER_LAYER`, or `loss_bytes`)."""
    loss = CASCADE_GRAPH_LOSS_BYTES_PER_LAYER if loss_bytes is None else loss_bytes
    if prefix_len <= 0 or num_reqs < CASCADE_MIN_REQUESTS:
        return False
    return prefix_len * (num_reqs - 1) * kv_bytes_per_token >= loss


def merge_attention_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Merge two partial attention results over disjoint key sets into the full one.

    Parameters
    ----------
    out_a, out_b:
        ``[T, H, D]`` each normalized over its own keys (any float dtype).
    lse_a, lse_b:
        ``[T, H]`` float natural-log sum of ``exp(score)`` over those keys; ``-inf`` where a
        part saw no key (it then weighs nothing).

    Returns
    -------
    torch.Tensor
        ``[T, H, D]`` in `out_a`'s dtype: ``(e^lse_a out_a + e^lse_b out_b) / (e^lse_a +
        e^lse_b)``, computed stably; zeros where neither part saw a key.
    """
    import torch

    acc = torch.promote_types(out_a.dtype, torch.float32)  # at least float32
    lse_a, lse_b = lse_a.to(acc), lse_b.to(acc)
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    w_a = torch.exp(lse_a - m)
    w_b = torch.exp(lse_b - m)
    total = w_a + w_b
    total = torch.where(total > 0, total, torch.ones_like(total))
    # A part that saw no key may hold NaN (0/0): weigh it by a select, not by a product.
    a = torch.where((w_a > 0)[..., None], out_a.to(acc) * (w_a / total)[..., None], 0.0)
    b = torch.where((w_b > 0)[..., None], out_b.to(acc) * (w_b / total)[..., None], 0.0)
    return (a + b).to(out_a.dtype)


def check_common_prefix_len(
    common_prefix_len: int, *, block_size: int, context_lens: Sequence[int]
) -> None:
    """Raise ValueError unless `common_prefix_len` is a valid cascade request for a step
    whose requests have `context_lens` (a multiple of `block_size`, at most the smallest
    context length, so that every query lies after the prefix)."""
    if common_prefix_len < 0 or common_prefix_len % block_size:
        raise ValueError(
            f"common_prefix_len={common_prefix_len} must be a non-negative multiple of the "
            f"block size {block_size} (cascade covers full shared blocks only)"
        )
    if common_prefix_len and common_prefix_len > min(context_lens, default=0):
        raise ValueError(
            f"common_prefix_len={common_prefix_len} exceeds the smallest context length "
            f"{min(context_lens, default=0)}: every query must lie after the shared prefix; "
            "compute it with pagedcore.attention.cascade.common_prefix_len"
        )
