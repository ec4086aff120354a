"""The metadata builder (the per-step plan) and the per-layer implementation."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedcore import AttentionImpl, CommonAttentionMetadata, MetadataBuilder

__all__ = ["ToySdpaImpl", "ToySdpaMetadata", "ToySdpaMetadataBuilder"]


@dataclass(frozen=True)
class ToySdpaMetadata:
    """The plan for one step: host-side lengths (so forward never syncs) and the block table.

    Attributes
    ----------
    query_start_loc:
        ``B + 1`` offsets of each request's new tokens in the flattened batch.
    seq_lens:
        ``B`` total tokens per request (history + new).
    block_table:
        ``[B, max_blocks]`` int64 on the device: physical block of each logical block.
    num_actual_tokens:
        Real tokens; rows past it are padding.
    causal:
        Whether queries see only keys at positions up to their own.
    """

    query_start_loc: list[int]
    seq_lens: list[int]
    block_table: torch.Tensor
    num_actual_tokens: int
    causal: bool


class ToySdpaMetadataBuilder(MetadataBuilder[ToySdpaMetadata]):
    """Copies what `forward` loops over to the host once per step."""

    def build(
        self, common: CommonAttentionMetadata, *, common_prefix_len: int = 0
    ) -> ToySdpaMetadata:
        return ToySdpaMetadata(
            query_start_loc=[int(x) for x in common.query_start_loc_cpu.tolist()],
            seq_lens=[int(x) for x in common.seq_lens_cpu.tolist()],
            block_table=common.block_table.long(),
            num_actual_tokens=common.num_actual_tokens,
            causal=common.causal,
        )


class ToySdpaImpl(AttentionImpl[ToySdpaMetadata]):
    """Gathers each request's K/V blocks and runs one SDPA call per request (float32 math)."""

    # No __init__: AttentionImpl's stores the arguments, then calls this hook.
    def check_supported(self) -> None:
        """Refuse the features `ToySdpaBackend` does not declare."""
        unsupported = {
            "alibi_slopes": self.alibi_slopes,
            "sliding_window": self.sliding_window,
            "logits_soft_cap": self.logits_soft_cap,
        }
        asked = [name for name, value in unsupported.items() if value is not None]
        if asked or self.kv_cache_dtype != "auto":
            raise NotImplementedError(
                f"toy_sdpa implements plain full attention only; got "
                f"{asked or self.kv_cache_dtype}. "
                "Use pagedcore.select_backend(...) to pick a backend that supports it"
            )

    def do_kv_cache_update(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write ``key``/``value`` ``[T, Hkv, D]`` to their slots; ``-1`` slots are skipped."""
        if not kv_cache.is_contiguous():
            raise ValueError("toy_sdpa needs a contiguous KV cache (it views it flat)")
        keep = slot_mapping >= 0
        slots = slot_mapping[keep].long()
        flat = kv_cache.view(2, -1, self.num_kv_heads, self.head_size)  # [2, blocks*B, Hkv, D]
        flat[0].index_copy_(0, slots, key[keep].to(kv_cache.dtype))
        flat[1].index_copy_(0, slots, value[keep].to(kv_cache.dtype))

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: ToySdpaMetadata,
        *,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention for ``query`` ``[T, Hq, D]``, reading all K/V from the paged cache."""
        out = torch.empty_like(query) if output is None else output
        block_size = kv_cache.shape[2]
        qsl, group = metadata.query_start_loc, self.num_queries_per_kv
        for req, seq_len in enumerate(metadata.seq_lens):
            start, end = qsl[req], qsl[req + 1]
            if end == start:
                continue
            num_blocks = -(-seq_len // block_size)
            blocks = metadata.block_table[req, :num_blocks]
            # [2, n, B, Hkv, D] -> [2, n*B, Hkv, D]; slots past seq_len are never read.
            kv = kv_cache[:, blocks].flatten(1, 2)[:, :seq_len].float()
            k = kv[0].transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, S, D]
            v = kv[1].transpose(0, 1).repeat_interleave(group, dim=0)
            q = query[start:end].float().transpose(0, 1)  # [Hq, q_len, D]
            mask = None
            if metadata.causal:
                # query i of q_len new tokens sits at position seq_len - q_len + i
                q_pos = torch.arange(seq_len - (end - start), seq_len, device=query.device)
                k_pos = torch.arange(seq_len, device=query.device)
                mask = k_pos[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
            out[start:end] = o.transpose(0, 1).to(out.dtype)
        out[metadata.num_actual_tokens :] = 0
        return out
