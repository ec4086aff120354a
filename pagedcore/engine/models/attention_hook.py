"""The bridge between transformers' attention layers and pagedcore backends.

`register()` adds an attention function named ``"pagedcore"`` to transformers'
`AttentionInterface`. A model whose ``config._attn_implementation`` is ``"pagedcore"`` calls it
in every attention layer; the engine passes the step's `StepContext` as the keyword argument
``pagedcore_ctx`` of the model's forward, and transformers forwards it to the function. Because
``"pagedcore"`` has no entry in `AttentionMaskInterface`, transformers builds no mask: causality,
windows and request boundaries come from the backend's metadata.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    import torch

    from pagedcore.attention.backend import AttentionImpl

__all__ = [
    "ATTN_IMPLEMENTATION", "LayerBinding", "StepContext", "paged_attention_tokens",
    "pagedcore_attention", "register",
]

#: The `attn_implementation` name pagedcore registers with transformers.
ATTN_IMPLEMENTATION = "pagedcore"
_registered = False


@attrs.define
class KVScaleCalibration:
    """An fp8 layer whose K/V scales are still to be computed from its first real cache
    write (the first prefill): ``max|x| / fp8 max`` per tensor. A write whose K (or V) is all
    zero or not finite gives no scale: that one stays 1.0, with a warning naming `layer`."""

    kv_cache_dtype: str
    pending: bool = True
    layer: int | str = "?"

    def maybe_calibrate(self, impl: AttentionImpl[Any], key: torch.Tensor,
                        value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Set `impl`'s scales from the real rows (slot >= 0) of this write, once; never
        while a CUDA graph is being captured (no host reads there) nor on padding only."""
        import torch

        if key.is_cuda and torch.cuda.is_current_stream_capturing():
            return
        n = min(key.shape[0], slot_mapping.shape[0])
        real = slot_mapping[:n] >= 0
        if not bool(real.any()):
            return
        impl.set_kv_scales(self._scale(key[:n][real], "k"), self._scale(value[:n][real], "v"))
        self.pending = False

    def _scale(self, x: torch.Tensor, which: str) -> float:
        """``max|x| / fp8 max``, or 1.0 (with a warning) when ``max|x|`` is 0 or not finite."""
        import math
        import warnings

        from pagedcore.attention.kv_quant import FP8_MAX, normalize_kv_cache_dtype

        amax = float(x.abs().amax())
        if math.isfinite(amax) and amax > 0:
            return amax / FP8_MAX[normalize_kv_cache_dtype(self.kv_cache_dtype)]
        what = "all zero" if amax == 0 else f"not finite (max |x| = {amax})"
        warnings.warn(
            f"layer {self.layer}: the first prefill's {which.upper()} is {what}, so no fp8 "
            f"{which}_scale can be computed from it; using {which}_scale = 1.0 (values beyond "
            f"+-{FP8_MAX[normalize_kv_cache_dtype(self.kv_cache_dtype)]:g} saturate). Give the "
            "checkpoint k_scale/v_scale tensors, or use kv_cache_dtype='auto'",
            RuntimeWarning, stacklevel=2,
        )
        return 1.0


@attrs.frozen
class LayerBinding:
    """What one attention layer uses: its impl, its cache tensor and its KV-cache group
    (and, for an fp8 cache awaiting its scales, their calibration)."""

    impl: AttentionImpl[Any]
    kv_cache: torch.Tensor
    group: int
    calibration: KVScaleCalibration | None = None


@attrs.frozen
class StepContext:
    """Per-step state the attention function needs (passed as ``pagedcore_ctx``).

    Attributes
    ----------
    layers:
        ``layer_idx`` (transformers' ``module.layer_idx``) -> binding.
    metadata:
        Per KV-cache group, what the group's builder returned for this step.
    slot_mappings:
        Per group, ``[T]`` int64 slot of each new token (-1 for padding).
    """

    layers: dict[int, LayerBinding]
    metadata: tuple[Any, ...]
    slot_mappings: tuple[torch.Tensor, ...]


def pagedcore_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    pagedcore_ctx: StepContext | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function backed by the layer's pagedcore `AttentionImpl`.

    Parameters
    ----------
    module:
        The transformers attention module (gives ``layer_idx``).
    query:
        ``[1, Hq, T, D]``, rotary embedding applied.
    key, value:
        ``[1, Hkv, T, D]``.
    attention_mask:
        Ignored (None: pagedcore registers no mask function).
    pagedcore_ctx:
        The step's `StepContext`; required.

    Returns
    -------
    tuple
        ``([1, T, Hq, D] output in the query dtype, None)`` — no attention weights.
    """
    # [1, H, T, D] -> [T, H, D]; a no-op copy when transformers' layout is already token-major.
    q = query[0].transpose(0, 1).contiguous()
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1).contiguous()
    out = paged_attention_tokens(module, q, k, v, pagedcore_ctx=pagedcore_ctx,
                                 sliding_window=sliding_window)
    return out.unsqueeze(0), None


def paged_attention_tokens(
    module: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    pagedcore_ctx: StepContext | None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """`pagedcore_attention` on token-major heads: the cache write, then the layer's
    attention (what a module that already holds ``[T, H, D]`` heads calls directly, skipping
    the ``[1, H, T, D]`` round trip of transformers' attention interface).

    Parameters
    ----------
    module:
        The attention module (gives ``layer_idx``).
    q:
        ``[T, Hq, D]``, rotary embedding applied.
    k, v:
        ``[T, Hkv, D]``.
    pagedcore_ctx:
        The step's `StepContext`; required.
    sliding_window:
        The layer's window as the model passes it (checked against the KV-cache group's).

    Returns
    -------
    torch.Tensor
        ``[T, Hq, D]`` in the query dtype.
    """
    if pagedcore_ctx is None:
        raise RuntimeError(
            "the model's attention implementation is 'pagedcore' but no pagedcore_ctx was "
            "passed; run it through pagedcore.LLM, or call model.set_attn_implementation('eager') "
            "to use it on its own"
        )
    binding = pagedcore_ctx.layers[module.layer_idx]
    impl = binding.impl
    if sliding_window != impl.sliding_window:
        raise RuntimeError(
            f"layer {module.layer_idx} runs with sliding_window={sliding_window} but its KV-cache "
            f"group was planned for {impl.sliding_window}; the model config and the KV-cache "
            "specs disagree"
        )
    slots = pagedcore_ctx.slot_mappings[binding.group]
    if binding.calibration is not None and binding.calibration.pending:
        binding.calibration.maybe_calibrate(impl, k, v, slots)
    impl.do_kv_cache_update(k, v, binding.kv_cache, slots)
    out: torch.Tensor = impl.forward(q, k, v, binding.kv_cache,
                                     pagedcore_ctx.metadata[binding.group])
    return out


def register() -> None:
    """Register ``"pagedcore"`` with transformers' `AttentionInterface` (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, pagedcore_attention)
    _registered = True
