"""`ReferenceImpl`: one layer's attention over the paged cache, in float32 torch."""

from __future__ import annotations

import torch

from pagedcore.attention.backend import AttentionImpl
from pagedcore.attention.kv_quant import FP8_KV_CACHE_DTYPES, quantize_fp8
from pagedcore.reference.metadata import ReferenceMetadata
from pagedcore.reference.ops import attend, gather_slots, write_slots

__all__ = ["ReferenceImpl"]

#: Upper bound on the score elements of one `attend` call (causal prefills are cut into query
#: slices to stay under it).
MAX_SCORES_PER_CALL = 1 << 24


def check_kv_cache(kv_cache: torch.Tensor, num_kv_heads: int, head_size: int) -> None:
    """Raise a ValueError unless `kv_cache` is ``[2, num_blocks, block_size, Hkv, D]``."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv_cache has shape {tuple(kv_cache.shape)}; the reference layout is "
            "[2, num_blocks, block_size, num_kv_heads, head_size] (see get_kv_cache_shape)"
        )
    if kv_cache.shape[3] != num_kv_heads or kv_cache.shape[4] != head_size:
        raise ValueError(
            f"kv_cache has {kv_cache.shape[3]} KV heads of size {kv_cache.shape[4]}, but this "
            f"layer has {num_kv_heads} of size {head_size}"
        )
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")


def write_kv_cache(
    kv_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    num_kv_heads: int,
    head_size: int,
    k_scale: torch.Tensor | float = 1.0,
    v_scale: torch.Tensor | float = 1.0,
) -> None:
    """Write `key`/`value` ``[T, Hkv, D]`` into the reference layout ``[2, num_blocks,
    block_size, Hkv, D]`` (index 0 K, 1 V) at `slot_mapping` ``[T]`` int64; ``-1`` is skipped.

    An fp8 cache stores `quantize_fp8` of the rows with `k_scale` / `v_scale` (floats or
    ``[1]`` float32 tensors); other caches ignore the scales."""
    check_kv_cache(kv_cache, num_kv_heads, head_size)
    if key.shape != value.shape or key.shape[0] != slot_mapping.shape[0]:
        raise ValueError(
            f"key {tuple(key.shape)}, value {tuple(value.shape)} and slot_mapping "
            f"{tuple(slot_mapping.shape)} must agree on [T, Hkv, D] / [T]"
        )
    if kv_cache.dtype.itemsize == 1:
        key = quantize_fp8(key, k_scale, kv_cache.dtype)
        value = quantize_fp8(value, v_scale, kv_cache.dtype)
    write_slots(kv_cache[0], key, slot_mapping)
    write_slots(kv_cache[1], value, slot_mapping)


class ReferenceImpl(AttentionImpl[ReferenceMetadata]):
    """Gathers each request group's K/V once per layer and runs one masked matmul on it.

    Supports every feature of the contract except MLA, fp8 caches and sinks included; see
    `AttentionImpl` for the parameters. An fp8 cache is quantized at the write and read back
    as ``float32(fp8) * scale`` (`pagedcore.attention.kv_quant`), exactly what a kernel reads.
    """

    def check_supported(self) -> None:
        # The reference serves every KV-cache dtype of the contract (its descriptor declares
        # KV_CACHE_DTYPES): a name added there without support here fails loudly.
        declared = ("auto", *FP8_KV_CACHE_DTYPES)
        if self.kv_cache_dtype not in declared:
            raise ValueError(
                f"the reference backend stores the KV cache as {', '.join(declared)}, got "
                f"kv_cache_dtype {self.kv_cache_dtype!r}"
            )

    def _kv_scales(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor | float, ...]:
        if kv_cache.dtype.itemsize != 1:
            return 1.0, 1.0
        if not self.kv_fp8:
            raise ValueError(
                f"kv_cache is {kv_cache.dtype} but this layer has kv_cache_dtype 'auto'; build "
                "the impl with kv_cache_dtype='fp8_e4m3' / 'fp8_e5m2' and its scales"
            )
        return self.kv_scales_on(kv_cache.device)

    def do_kv_cache_update(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write ``key``/``value`` ``[T, Hkv, D]`` to their slots; ``-1`` slots are skipped.

        `kv_cache` is ``[2, num_blocks, block_size, Hkv, D]``; index 0 holds K, 1 holds V.
        """
        k_scale, v_scale = self._kv_scales(kv_cache)
        write_kv_cache(kv_cache, key, value, slot_mapping,
                       num_kv_heads=self.num_kv_heads, head_size=self.head_size,
                       k_scale=k_scale, v_scale=v_scale)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: ReferenceMetadata,
        *,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention for the flattened batch; see `AttentionImpl.forward`.

        Parameters
        ----------
        query:
            ``[T, Hq, D]`` in the model dtype.
        key, value:
            ``[T, Hkv, D]``; unused (this step's K/V is read back from the cache).
        kv_cache:
            ``[2, num_blocks, block_size, Hkv, D]``.
        metadata:
            From `ReferenceMetadataBuilder.build`.
        output:
            Optional ``[T, Hq, D]`` buffer; padding rows are left untouched.

        Returns
        -------
        torch.Tensor
            ``[T, Hq, D]`` in ``query.dtype`` (`output` when given); padding rows are zero
            when `output` is None.
        """
        check_kv_cache(kv_cache, self.num_kv_heads, self.head_size)
        if query.dim() != 3 or query.shape[1:] != (self.num_heads, self.head_size):
            raise ValueError(
                f"query has shape {tuple(query.shape)}, expected [T, {self.num_heads}, "
                f"{self.head_size}]"
            )
        if output is None:
            output = torch.zeros_like(query)
        slopes = self.alibi_slopes_on(query.device)
        sinks = self.sinks_on(query.device)
        k_scale, v_scale = self._kv_scales(kv_cache)
        causal = metadata.common.causal
        for group in metadata.groups:
            n, lq, lk = group.num_reqs, group.query_len, group.slots.shape[1]
            q = query.index_select(0, group.token_rows).view(n, lq, *query.shape[1:])
            k = gather_slots(kv_cache[0], group.slots)
            v = gather_slots(kv_cache[1], group.slots)
            if kv_cache.dtype.itemsize == 1:
                k, v = k.mul_(k_scale), v.mul_(v_scale)
            # Causal queries never see keys past their own position, so a long prefill can be
            # cut into query slices (each with the keys up to its last query) to bound memory.
            step = max(1, MAX_SCORES_PER_CALL // (n * lk * self.num_heads)) if causal else lq
            out = torch.empty(
                n, lq, self.num_heads, self.head_size, dtype=torch.float32, device=query.device
            )
            for a in range(0, lq, step):
                b = min(lq, a + step)
                cut = lq - b
                out[:, a:b] = attend(
                    q[:, a:b].to(torch.float32),
                    k[:, : lk - cut],
                    v[:, : lk - cut],
                    group.seq_lens - cut,
                    scale=self.scale,
                    causal=causal,
                    alibi_slopes=slopes,
                    sliding_window=self.sliding_window,
                    logits_soft_cap=self.logits_soft_cap,
                    # k and v are this call's own gathers: zero their invisible rows in
                    # place when there is one slice (with several, a row padding for one
                    # request's early slice is a real key of its later slices).
                    overwrite_kv=step >= lq,
                    sinks=sinks,
                )
            rows = out.view(n * lq, self.num_heads, self.head_size)
            output.index_copy_(0, group.token_rows, rows.to(output.dtype))
        return output
