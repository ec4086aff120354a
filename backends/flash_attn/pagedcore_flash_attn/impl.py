"""Per-layer attention: a torch cache write and one ``flash_attn_varlen_func`` call per step."""

from __future__ import annotations

import torch

from pagedcore.attention.backend import AttentionImpl
from pagedcore_flash_attn import flash_api
from pagedcore_flash_attn.capabilities import HEAD_SIZES
from pagedcore_flash_attn.metadata import FlashAttnMetadata

__all__ = ["FlashAttnImpl"]


def _check_cache(kv_cache: torch.Tensor, num_kv_heads: int, head_size: int) -> None:
    if (
        kv_cache.dim() != 5
        or kv_cache.shape[0] != 2
        or kv_cache.shape[3] != num_kv_heads
        or kv_cache.shape[4] != head_size
    ):
        raise ValueError(
            f"kv_cache has shape {tuple(kv_cache.shape)}; the flash_attn backend expects "
            f"[2, num_blocks, block_size, {num_kv_heads}, {head_size}] "
            "(allocate it with FlashAttnBackend.get_kv_cache_shape)"
        )
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous; allocate it with torch.empty(shape)")


class FlashAttnImpl(AttentionImpl[FlashAttnMetadata]):
    """One attention layer over FlashAttention-2's paged varlen kernel.

    The cache ``[2, num_blocks, block_size, Hkv, D]`` splits into ``kv_cache[0]`` and
    ``kv_cache[1]``, which are exactly flash-attn's paged ``k`` and ``v``
    (``[num_blocks, block_size, Hkv, D]``), so nothing is copied per step. The constructor
    takes `AttentionImpl`'s arguments; see there.

    Examples
    --------
    >>> impl = FlashAttnImpl(32, 128, 128**-0.5, num_kv_heads=8, sliding_window=4096)
    >>> impl.window_size
    (4095, 0)
    """

    def check_supported(self) -> None:
        if self.kv_cache_dtype != "auto":
            raise ValueError(
                f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported by the flash_attn "
                "backend (FlashAttention-2 reads fp16/bf16 caches only); use kv_cache_dtype='auto'"
            )
        if self.head_size not in HEAD_SIZES:
            raise ValueError(
                f"head size {self.head_size} is not supported by the flash_attn backend: "
                "FlashAttention-2 needs a multiple of 8 up to 256"
            )

    def setup(self) -> None:
        window = self.sliding_window
        #: flash-attn's ``(left, right)``: a window of W keys is the query plus W - 1 before it.
        self.window_size: tuple[int, int] = (-1, -1) if window is None else (window - 1, 0)
        self._varlen: flash_api.VarlenFunc | None = None

    def do_kv_cache_update(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Scatter this step's K/V into the paged cache (pure torch, skips ``-1`` slots).

        Parameters
        ----------
        key, value:
            ``[T, Hkv, D]`` in the cache dtype.
        kv_cache:
            ``[2, num_blocks, block_size, Hkv, D]``.
        slot_mapping:
            ``[T]`` int64; ``block_id * block_size + offset``, ``-1`` for padding tokens.
        """
        _check_cache(kv_cache, self.num_kv_heads, self.head_size)
        if key.shape != value.shape or key.shape[0] != slot_mapping.shape[0]:
            raise ValueError(
                f"key {tuple(key.shape)}, value {tuple(value.shape)} and slot_mapping "
                f"{tuple(slot_mapping.shape)} must describe the same [T] tokens"
            )
        if key.dtype != kv_cache.dtype or value.dtype != kv_cache.dtype:
            raise ValueError(
                f"key/value dtype {key.dtype}/{value.dtype} differs from the cache dtype "
                f"{kv_cache.dtype}; allocate the cache in the model dtype"
            )
        num_slots = kv_cache.shape[1] * kv_cache.shape[2]
        valid = slot_mapping >= 0
        slots = slot_mapping[valid].to(torch.int64)
        for cache, new in ((kv_cache[0], key), (kv_cache[1], value)):
            cache.view(num_slots, self.num_kv_heads, self.head_size).index_copy_(
                0, slots, new[valid]
            )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: FlashAttnMetadata,
        *,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention for the step's real tokens through ``flash_attn_varlen_func``.

        Parameters
        ----------
        query:
            ``[T, Hq, D]`` float16/bfloat16.
        key, value:
            ``[T, Hkv, D]``; unused (this step's K/V are read back from the cache).
        kv_cache:
            ``[2, num_blocks, block_size, Hkv, D]`` with ``block_size % 256 == 0``.
        metadata:
            The step's `FlashAttnMetadata`.
        output:
            Optional ``[T, Hq, D]`` buffer.

        Returns
        -------
        torch.Tensor
            ``[T, Hq, D]``; rows past ``metadata.num_actual_tokens`` are left untouched.
        """
        _check_cache(kv_cache, self.num_kv_heads, self.head_size)
        num_tokens = metadata.num_actual_tokens
        if metadata.num_reqs == 0 or num_tokens == 0:
            return torch.empty_like(query) if output is None else output
        if not metadata.causal and self.alibi_slopes is not None:
            # flash-attn's non-causal ALiBi bias is -slope * |pos_q - pos_k|, not pagedcore's
            # slope * (pos_k - pos_q); the two agree only under the causal mask.
            raise ValueError(
                "the flash_attn backend supports ALiBi only for causal attention "
                "(flash-attn applies a symmetric bias otherwise); use another backend"
            )
        if self._varlen is None:
            self._varlen = flash_api.load_varlen_func()
        result = self._varlen(
            query[:num_tokens],
            kv_cache[0],
            kv_cache[1],
            metadata.cu_seqlens_q,
            metadata.cu_seqlens_k,
            metadata.max_seqlen_q,
            metadata.max_seqlen_k,
            softmax_scale=self.scale,
            causal=metadata.causal,
            window_size=self.window_size,
            softcap=0.0 if self.logits_soft_cap is None else float(self.logits_soft_cap),
            alibi_slopes=self.alibi_slopes_on(query.device),
            block_table=metadata.block_table,
        )
        if output is None:
            if num_tokens == query.shape[0]:
                return result
            output = torch.empty_like(query)
        output[:num_tokens].copy_(result)
        return output
