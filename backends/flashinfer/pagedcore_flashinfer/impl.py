"""Per-layer attention: a torch cache write, then FlashInfer's decode and/or prefill run.

With an fp8 cache the write stores ``fp8(x / scale)`` (`pagedcore.attention.kv_quant`) and the
forward pass hands FlashInfer the fp8 cache as it is (its FA2 kernels widen K/V on chip). The
layer's scales are applied on the device around FlashInfer's call, not through ``run()``'s
``k_scale`` / ``v_scale``: those are Python floats that FlashInfer folds into the kernel's
arguments, which a captured CUDA graph would keep at their capture-time values, while the
engine calibrates the scales after capturing its decode graphs (`AttentionImpl.set_kv_scales`
updates the device copies in place). ``q · k_scale`` enters the query (one rounding to the
query's dtype) and ``v_scale`` multiplies the output rows.
"""

from __future__ import annotations

import torch

from pagedcore.attention.backend import AttentionImpl
from pagedcore.attention.kv_quant import kv_cache_torch_dtype, quantize_fp8
from pagedcore_flashinfer.capabilities import HEAD_SIZES, KV_CACHE_DTYPES
from pagedcore_flashinfer.metadata import FlashInferMetadata, LayerParams

__all__ = ["FlashInferImpl"]


def _check_cache(kv_cache: torch.Tensor, num_kv_heads: int, head_size: int) -> None:
    if (
        kv_cache.dim() != 5
        or kv_cache.shape[1] != 2
        or kv_cache.shape[3] != num_kv_heads
        or kv_cache.shape[4] != head_size
    ):
        raise ValueError(
            f"kv_cache has shape {tuple(kv_cache.shape)}; the flashinfer backend expects "
            f"FlashInfer's NHD layout [num_blocks, 2, block_size, {num_kv_heads}, {head_size}] "
            "(allocate it with FlashInferBackend.get_kv_cache_shape)"
        )
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous; allocate it with torch.empty(shape)")


class FlashInferImpl(AttentionImpl[FlashInferMetadata]):
    """One attention layer over FlashInfer's paged wrappers.

    The cache is FlashInfer's own NHD paged tensor ``[num_blocks, 2, block_size, Hkv, D]``
    (``[:, 0]`` K, ``[:, 1]`` V), passed to ``run()`` as is. The constructor takes
    `AttentionImpl`'s arguments; see there.

    Examples
    --------
    >>> impl = FlashInferImpl(32, 128, 128**-0.5, num_kv_heads=8, sliding_window=4096)
    >>> impl.window_left
    4095
    """

    def check_supported(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported by the flashinfer "
                f"backend; use one of {KV_CACHE_DTYPES}"
            )
        if self.sinks is not None:
            raise ValueError(
                "the flashinfer backend does not take attention sinks (its FA2 paged kernels "
                "have no sink term); pick a backend that declares supports_sink"
            )
        if self.head_size not in HEAD_SIZES:
            raise ValueError(
                f"head size {self.head_size} is not supported by the flashinfer backend "
                f"(FlashInfer's kernels are built for {HEAD_SIZES}); pick another backend"
            )
        if self.alibi_slopes is not None:
            raise ValueError(
                "the flashinfer backend does not take ALiBi slopes (FlashInfer's paged "
                "wrappers derive their own from the head count); pick another backend"
            )

    def setup(self) -> None:
        #: FlashInfer's inclusive left window: a window of W keys is the query plus W - 1.
        self.window_left: int = -1 if self.sliding_window is None else self.sliding_window - 1

    def do_kv_cache_update(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Scatter this step's K/V into the paged cache (pure torch, skips ``-1`` slots).

        No data-dependent shapes (no boolean indexing, whose ``nonzero`` syncs with the host
        and breaks CUDA-graph capture): a ``-1`` slot is sent to slot 0 of the null block
        (block 0, which no request's token is ever written to) and writes back the value
        already there, so every write to that slot is the same and the cache is unchanged.

        Parameters
        ----------
        key, value:
            ``[T, Hkv, D]`` in the model dtype; quantized to ``fp8(x / scale)`` with this
            layer's ``k_scale`` / ``v_scale`` when the cache is fp8.
        kv_cache:
            ``[num_blocks, 2, block_size, Hkv, D]``.
        slot_mapping:
            ``[T]`` int64; ``block_id * block_size + offset``, ``-1`` for padding tokens.
        """
        _check_cache(kv_cache, self.num_kv_heads, self.head_size)
        if key.shape != value.shape or key.shape[0] != slot_mapping.shape[0]:
            raise ValueError(
                f"key {tuple(key.shape)}, value {tuple(value.shape)} and slot_mapping "
                f"{tuple(slot_mapping.shape)} must describe the same [T] tokens"
            )
        if self.kv_fp8:
            expected = kv_cache_torch_dtype(self.kv_cache_dtype, key.dtype)
            if kv_cache.dtype != expected:
                raise ValueError(
                    f"kv_cache is {kv_cache.dtype} but this layer's kv_cache_dtype is "
                    f"{self.kv_cache_dtype!r} ({expected}); allocate the cache in {expected}"
                )
            k_scale, v_scale = self.kv_scales_on(kv_cache.device)
            key = quantize_fp8(key, k_scale, kv_cache.dtype)
            value = quantize_fp8(value, v_scale, kv_cache.dtype)
        elif key.dtype != kv_cache.dtype or value.dtype != kv_cache.dtype:
            raise ValueError(
                f"key/value dtype {key.dtype}/{value.dtype} differs from the cache dtype "
                f"{kv_cache.dtype}; allocate the cache in the model dtype (or pass "
                "kv_cache_dtype='fp8' to the impl for an fp8 cache)"
            )
        block_size = kv_cache.shape[2]
        keep = (slot_mapping >= 0)[:, None, None]
        slots = slot_mapping.to(torch.int64).clamp_min(0)
        blocks, offsets = slots // block_size, slots % block_size
        kv_cache[blocks, 0, offsets] = torch.where(keep, key, kv_cache[0, 0, 0])
        kv_cache[blocks, 1, offsets] = torch.where(keep, value, kv_cache[0, 1, 0])

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: FlashInferMetadata,
        *,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention for the step's real tokens through FlashInfer.

        Parameters
        ----------
        query:
            ``[T, Hq, D]`` float16/bfloat16.
        key, value:
            ``[T, Hkv, D]``; unused (this step's K/V are read back from the cache).
        kv_cache:
            ``[num_blocks, 2, block_size, Hkv, D]``, in the model dtype or fp8.
        metadata:
            The step's `FlashInferMetadata`.
        output:
            Optional ``[T, Hq, D]`` buffer.

        Returns
        -------
        torch.Tensor
            ``[T, Hq, D]``; rows past ``metadata.num_actual_tokens`` are left untouched.
        """
        _check_cache(kv_cache, self.num_kv_heads, self.head_size)
        if output is None:
            output = torch.empty_like(query)
        num_tokens = metadata.num_actual_tokens
        if metadata.num_reqs == 0 or num_tokens == 0:
            return output
        params = LayerParams(
            num_qo_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_size,
            window_left=self.window_left,
            logits_soft_cap=self.logits_soft_cap,
            sm_scale=self.scale,
            q_dtype=query.dtype,
            kv_dtype=kv_cache.dtype,
        )
        decode, prefill = metadata.planner.planned_wrappers(metadata, params)
        split = metadata.num_decode_tokens
        v_scale = None
        if self.kv_fp8:
            k_scale, v_scale = self.kv_scales_on(query.device)
            # float32 product, one rounding to the query dtype (a fresh contiguous tensor).
            real = query[:num_tokens]
            scaled = torch.empty(real.shape, dtype=real.dtype, device=real.device)
            query = torch.mul(real, k_scale, out=scaled)
        elif query.stride(-1) != 1:
            query = query.contiguous()
        if decode is not None:
            decode.run(query[:split], kv_cache, out=output[:split])
        if prefill is not None:
            prefill.run(query[split:num_tokens], kv_cache, out=output[split:num_tokens])
        if v_scale is not None:
            output[:num_tokens].mul_(v_scale)
        return output
