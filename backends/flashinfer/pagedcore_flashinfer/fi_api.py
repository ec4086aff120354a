"""The FlashInfer classes this backend calls, and where they come from.

`load_flashinfer` imports FlashInfer on first use (never at ``import pagedcore_flashinfer``).
Tests replace `load_flashinfer` with one returning a test double exposing the same names.

The two wrappers, as this backend uses them (flashinfer-python 0.7.2):

``BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)``
    ``plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
    *, window_left, logits_soft_cap, sm_scale, q_data_type, kv_data_type)`` then
    ``run(q, paged_kv_cache, *, out)``; one query token per request.
``BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")``
    ``plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
    num_qo_heads, num_kv_heads, head_dim_qk, page_size, *, causal, sm_scale, window_left,
    logits_soft_cap, q_data_type, kv_data_type)`` then ``run(q, paged_kv_cache, *, out)``.

Shapes: ``indptr`` / ``qo_indptr`` ``[B + 1]`` int32 (host), ``indices`` ``[indptr[-1]]``
int32 (device), ``last_page_len`` ``[B]`` int32 in ``[1, page_size]`` (host); ``q`` ``[T, Hq,
D]``; ``paged_kv_cache`` ``[num_blocks, 2, page_size, Hkv, D]`` (NHD); ``out`` like ``q``.
"""

from __future__ import annotations

from typing import Any, Protocol

from pagedcore_flashinfer import capabilities

__all__ = ["FlashInferAPI", "FlashInferMLAAPI", "load_flashinfer", "load_flashinfer_mla"]


class FlashInferAPI(Protocol):
    """The part of the ``flashinfer`` module this backend uses."""

    BatchDecodeWithPagedKVCacheWrapper: Any
    BatchPrefillWithPagedKVCacheWrapper: Any


class FlashInferMLAAPI(Protocol):
    """The part of FlashInfer the ``flashinfer_mla`` backend uses (``flashinfer.mla``):
    ``BatchMLAPagedAttentionWrapper(workspace, backend=...)`` whose
    ``plan(metadata=MLAPlanMetadata.csr(qo_indptr, kv_indptr, kv_indices, kv_len_arr),
    num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale, q_data_type,
    kv_data_type)`` and ``run(query=[T, H, L + R], kv_cache=[N, page, L + R], out=[T, H, L])``
    take the packed layouts (all keywords)."""

    BatchMLAPagedAttentionWrapper: Any
    MLAPlanMetadata: Any


def load_flashinfer_mla() -> FlashInferMLAAPI:
    """Import ``flashinfer.mla`` (as `load_flashinfer` does ``flashinfer``).

    Raises
    ------
    RuntimeError
        When it cannot be imported, with the import error and what to do.
    """
    load_flashinfer()
    try:
        import flashinfer.mla as mla
    except Exception as err:
        reason = (
            f"flashinfer.mla failed to import ({type(err).__name__}: {err}); reinstall "
            f"FlashInfer with `{capabilities.INSTALL_HINT}` or pick backend='triton_mla'"
        )
        capabilities.record_load_failure(reason)
        raise RuntimeError(reason) from err
    api: FlashInferMLAAPI = mla
    return api


def load_flashinfer() -> FlashInferAPI:
    """Import ``flashinfer``.

    Raises
    ------
    RuntimeError
        When FlashInfer cannot be imported, with the import error and what to do; the reason
        is also remembered so that `FlashInferBackend.is_available` reports it from then on.
    """
    try:
        import flashinfer
    except Exception as err:  # ImportError, or a CUDA/JIT error raised at import time
        reason = (
            f"FlashInfer failed to import ({type(err).__name__}: {err}); reinstall it with "
            f"`{capabilities.INSTALL_HINT}` or pick another backend (backend='triton')"
        )
        capabilities.record_load_failure(reason)
        raise RuntimeError(reason) from err
    capabilities.record_load_failure(None)
    api: FlashInferAPI = flashinfer
    return api
