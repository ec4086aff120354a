"""The MLA backend descriptor every MLA backend derives from: one latent row per token.

The impl contract (query / cache / output shapes) is written in `pagedcore.reference.mla`.
"""

from __future__ import annotations

from typing import ClassVar

from pagedcore.attention.backend import KV_CACHE_DTYPE_ALIASES, KV_CACHE_DTYPES, AttentionBackend

__all__ = ["MLAAttentionBackend", "check_mla_cache_shape"]


def check_mla_cache_shape(num_kv_heads: int, head_size: int, cache_dtype: str) -> None:
    """Raise a ValueError when an MLA cache is asked for with more than one KV head, a
    non-positive row size or an unknown ``cache_dtype`` (``"auto"`` or an fp8 name: an fp8
    latent cache holds ``fp8(row / k_scale)``, one per-layer scale for the whole row)."""
    if num_kv_heads != 1:
        raise ValueError(
            f"an MLA KV cache holds one latent head per token; got num_kv_heads={num_kv_heads}. "
            "Pass num_kv_heads=1 (MLAAttentionSpec does)"
        )
    if head_size <= 0:
        raise ValueError(f"MLA head_size (kv_lora_rank + rope_head_dim) must be positive, "
                         f"got {head_size}")
    if KV_CACHE_DTYPE_ALIASES.get(cache_dtype, cache_dtype) not in KV_CACHE_DTYPES:
        raise ValueError(f"MLA cache dtype must be one of {KV_CACHE_DTYPES} (or 'fp8'), "
                         f"got {cache_dtype!r}")


class MLAAttentionBackend(AttentionBackend):
    """Base descriptor of an MLA-only backend.

    Declares MLA support and the paged latent cache shape ``(num_blocks, block_size, L + R)``
    (one latent "head" of ``kv_lora_rank + rope_head_dim`` values per token, no K/V doubling).
    Subclasses still name their builder and impl classes.
    """

    supports_mla: ClassVar[bool] = True
    mla_only: ClassVar[bool] = True

    @classmethod
    def get_kv_cache_shape(
        cls,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype: str = "auto",
    ) -> tuple[int, ...]:
        """``(num_blocks, block_size, head_size)``: one latent row of ``L + R`` per token
        (fp8 caches too: one byte per element; a `cache_dtype` the backend does not declare
        in ``supported_kv_cache_dtypes`` is a ValueError)."""
        check_mla_cache_shape(num_kv_heads, head_size, cache_dtype)
        name = KV_CACHE_DTYPE_ALIASES.get(cache_dtype, cache_dtype)
        if name not in cls.supported_kv_cache_dtypes:
            raise ValueError(
                f"{cls.name} stores no {name} latent cache (supports "
                f"{', '.join(cls.supported_kv_cache_dtypes)}); pick kv_cache_dtype='auto' or an "
                "MLA backend that declares it"
            )
        return (num_blocks, block_size, head_size)
