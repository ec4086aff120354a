"""The one flash-attn function this backend calls, and where it comes from.

`load_varlen_func` imports flash-attn on first use (never at ``import pagedcore_flash_attn``).
Tests replace `load_varlen_func` with one returning a test double of the same signature.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

__all__ = ["VarlenFunc", "load_varlen_func"]


class VarlenFunc(Protocol):
    """Signature of ``flash_attn.flash_attn_varlen_func`` (2.6.2+) as this backend calls it.

    Parameters
    ----------
    q:
        ``[total_q, Hq, D]`` float16/bfloat16.
    k, v:
        ``[num_blocks, block_size, Hkv, D]``, same dtype, last dimension contiguous; with
        ``block_table`` given they are the paged cache (``block_size % 256 == 0``).
    cu_seqlens_q:
        ``[B + 1]`` int32, cumulative query lengths.
    cu_seqlens_k:
        ``[B + 1]`` int32, cumulative key lengths (with a block table only the differences
        matter: request ``b`` has ``cu_seqlens_k[b + 1] - cu_seqlens_k[b]`` keys).
    max_seqlen_q, max_seqlen_k:
        Largest query / key length in the batch.
    softmax_scale:
        Scale of ``q·k``.
    causal:
        Causal mask aligned to the bottom-right corner (the last query sees every key).
    window_size:
        ``(left, right)``; ``-1`` means unbounded. Query ``i`` sees keys
        ``[i + sk - sq - left, i + sk - sq + right]``.
    softcap:
        ``> 0`` enables ``softcap * tanh(s / softcap)``; ``0.0`` disables it.
    alibi_slopes:
        ``[Hq]`` or ``[B, Hq]`` float32; adds ``-slope * |i + sk - sq - j|``.
    block_table:
        ``[B, max_blocks]`` int32, last dimension contiguous.

    Returns
    -------
    torch.Tensor
        ``[total_q, Hq, D]`` in the dtype of ``q``; rows whose keys are all masked are zero.
    """

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        *,
        softmax_scale: float,
        causal: bool,
        window_size: tuple[int, int],
        softcap: float,
        alibi_slopes: torch.Tensor | None,
        block_table: torch.Tensor,
    ) -> torch.Tensor: ...


def load_varlen_func() -> VarlenFunc:
    """Import ``flash_attn.flash_attn_varlen_func``.

    Raises
    ------
    RuntimeError
        When flash-attn (or its compiled extension) cannot be imported, with the import error
        and what to do.
    """
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError as err:  # the compiled extension is the usual culprit
        raise RuntimeError(
            f"the flash_attn backend could not import flash-attn ({err}); flash-attn must be "
            "built against the installed torch: reinstall it with "
            "`pip install --force-reinstall --no-build-isolation 'flash-attn>=2.6.2'`, or pick "
            "another backend (backend='triton')"
        ) from err
    func: VarlenFunc = flash_attn_varlen_func
    return func
