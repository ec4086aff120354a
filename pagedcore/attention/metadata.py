"""Backend-agnostic per-step attention metadata and the decode/prefill helpers."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    import torch

__all__ = [
    "CommonAttentionMetadata",
    "decode_first_order",
    "split_decodes_and_prefills",
]


@attrs.frozen(kw_only=True)
class CommonAttentionMetadata:
    """What every backend needs to know about one engine step, for one KV-cache group.

    ``B`` is the number of requests in the step, ``T`` the number of flattened tokens (possibly
    padded past ``num_actual_tokens``).

    Attributes
    ----------
    query_start_loc:
        ``[B + 1]`` int32 on the device; request ``i``'s new tokens are
        ``query_start_loc[i]:query_start_loc[i + 1]`` of the flattened batch.
    query_start_loc_cpu:
        The same on the CPU.
    seq_lens:
        ``[B]`` int32 on the device; tokens of request ``i`` after this step (history + new).
    seq_lens_cpu:
        The same on the CPU.
    num_reqs:
        ``B``.
    num_actual_tokens:
        Real (unpadded) tokens in the step, ``query_start_loc[B]``.
    max_query_len:
        Largest number of new tokens of any request.
    max_seq_len:
        Largest ``seq_lens`` entry.
    block_table:
        ``[B, max_blocks]`` int32 on the device; physical block ids per logical block. Entries
        past a request's last block are unspecified (the engine leaves 0, the null block).
    slot_mapping:
        ``[T]`` int64 on the device; where each new token's K/V is written, ``-1`` for padding.
    positions:
        ``[T]`` int64 on the device; each new token's position in its sequence.
    causal:
        True for decoder self-attention.
    common_prefix_len:
        Leading tokens that every request of the step holds in the *same physical blocks*
        (a multiple of the block size, at most the smallest context length, 0 = none; the
        runner computes it from the block tables with `pagedcore.attention.cascade`). What is
        shared, not what a backend must do: `MetadataBuilder.build`'s ``common_prefix_len``
        argument says whether cascade is used this step.
    """

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    causal: bool = True
    common_prefix_len: int = 0

    @property
    def query_lens_cpu(self) -> torch.Tensor:
        """``[B]`` int32 on the CPU: new tokens per request."""
        return self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]

    @property
    def context_lens_cpu(self) -> torch.Tensor:
        """``[B]`` int32 on the CPU: tokens already in the cache before this step."""
        return self.seq_lens_cpu - self.query_lens_cpu


def split_decodes_and_prefills(
    common: CommonAttentionMetadata, decode_threshold: int = 1
) -> tuple[int, int, int, int]:
    """Split a decode-first batch into its decode and prefill parts.

    Returns ``(num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens)``. Requests
    with at most `decode_threshold` query tokens count as decodes; the batch must already be
    in decode-first order (see `decode_first_order`), else a ValueError says so.
    """
    query_lens = common.query_lens_cpu.tolist()
    num_decodes = 0
    while num_decodes < len(query_lens) and query_lens[num_decodes] <= decode_threshold:
        num_decodes += 1
    if any(q <= decode_threshold for q in query_lens[num_decodes:]):
        raise ValueError(
            "batch is not in decode-first order: a request with <= "
            f"{decode_threshold} query tokens follows a longer one (query lens {query_lens}); "
            "reorder it with decode_first_order()"
        )
    num_decode_tokens = sum(query_lens[:num_decodes])
    num_prefill_tokens = sum(query_lens[num_decodes:])
    return num_decodes, len(query_lens) - num_decodes, num_decode_tokens, num_prefill_tokens


def decode_first_order(query_lens: list[int], decode_threshold: int = 1) -> list[int]:
    """A stable permutation of request indices that puts decodes (<= threshold) first."""
    decodes = [i for i, q in enumerate(query_lens) if q <= decode_threshold]
    prefills = [i for i, q in enumerate(query_lens) if q > decode_threshold]
    return decodes + prefills
