"""The flash_attn backend's per-step plan: FlashAttention's varlen arguments, built once."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import torch

from pagedcore.attention.backend import MetadataBuilder

if TYPE_CHECKING:
    from pagedcore.attention.metadata import CommonAttentionMetadata

__all__ = ["FlashAttnMetadata", "FlashAttnMetadataBuilder"]


@attrs.frozen(kw_only=True)
class FlashAttnMetadata:
    """Arguments of ``flash_attn_varlen_func`` shared by every layer of a KV-cache group.

    Attributes
    ----------
    cu_seqlens_q:
        ``[B + 1]`` int32; ``CommonAttentionMetadata.query_start_loc``.
    cu_seqlens_k:
        ``[B + 1]`` int32; ``0`` then the running sum of ``seq_lens`` (history + new tokens).
    block_table:
        ``[B, max_blocks]`` int32 with a contiguous last dimension.
    max_seqlen_q:
        Largest number of new tokens of any request.
    max_seqlen_k:
        Largest ``seq_lens`` entry.
    num_reqs:
        ``B``.
    num_actual_tokens:
        Real tokens in the step; rows past it are padding and are not passed to flash-attn.
    causal:
        Decoder self-attention (bottom-right aligned causal mask).
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    block_table: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    num_reqs: int
    num_actual_tokens: int
    causal: bool


class FlashAttnMetadataBuilder(MetadataBuilder[FlashAttnMetadata]):
    """Turns the step's common metadata into `FlashAttnMetadata`.

    flash-attn runs decode and prefill requests in one varlen call, so the batch order does
    not matter to it; ``common_prefix_len`` (cascade attention) is accepted and ignored, since
    FlashAttention-2 has no cascade kernel.
    """

    def build(
        self, common: CommonAttentionMetadata, *, common_prefix_len: int = 0
    ) -> FlashAttnMetadata:
        """Plan one step.

        Raises
        ------
        ValueError
            When the block table has too few columns for the longest sequence (flash-attn
            would read past it).
        """
        block_size = self.kv_cache_spec.block_size
        block_table = common.block_table
        capacity = block_table.shape[1] * block_size
        if common.num_reqs > 0 and common.max_seq_len > capacity:
            raise ValueError(
                f"block_table has {block_table.shape[1]} columns of {block_size} tokens "
                f"({capacity} tokens) but max_seq_len is {common.max_seq_len}; the engine "
                "must give every request enough block-table columns for its whole sequence"
            )
        if block_table.dtype != torch.int32 or block_table.stride(-1) != 1:
            block_table = block_table.to(torch.int32).contiguous()
        seq_lens = common.seq_lens.to(torch.int32)
        cu_seqlens_k = torch.zeros(common.num_reqs + 1, dtype=torch.int32, device=seq_lens.device)
        cu_seqlens_k[1:] = torch.cumsum(seq_lens[: common.num_reqs], dim=0, dtype=torch.int32)
        return FlashAttnMetadata(
            cu_seqlens_q=common.query_start_loc.to(torch.int32).contiguous(),
            cu_seqlens_k=cu_seqlens_k,
            block_table=block_table,
            max_seqlen_q=common.max_query_len,
            max_seqlen_k=common.max_seq_len,
            num_reqs=common.num_reqs,
            num_actual_tokens=common.num_actual_tokens,
            causal=common.causal,
        )
