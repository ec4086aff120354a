"""MLA backends side by side through the backend API (``pagedcore bench mla --backend NAME``).

Each named backend serves the same DeepSeek-V2-Lite decode steps as `pagedcore.bench.mla_kernel`
(16 query heads, latent 512 + rope 64, block size 16, permuted physical blocks, NaN in the null
block and past each context) the way the engine calls it: its own metadata builder's ``build``
once per step, then its impl's ``forward``. Rows give the device time of ``forward`` with the
step's plan reused (the engine plans once per step and runs it in every layer), the achieved
latent-cache bandwidth, and the relative error against the reference MLA (float32).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pagedcore.bench.mla_kernel import LATENT, NUM_HEADS, ROPE, _decode_batch

if TYPE_CHECKING:
    import torch

    from pagedcore.attention.backend import AttentionBackend

__all__ = ["BACKEND_CASES", "QUICK_BACKEND_CASES", "backend_rows", "resolve_mla_backends"]

#: (batch, context) decode steps of the side-by-side: many medium, few long, many short.
BACKEND_CASES = ((64, 4096), (4, 32768), (256, 1024))
QUICK_BACKEND_CASES = ((2, 64),)
SCALE = (128 + ROPE) ** -0.5


def resolve_mla_backends(
    names: Sequence[str], device: torch.device
) -> list[type[AttentionBackend]]:
    """The registered backends `names`, each checked to serve this bench's MLA shape.

    Raises
    ------
    ValueError
        For an unknown name (the registry's message lists the registered ones), a backend
        that does not declare MLA, or one whose declarations refuse the bench's configuration
        (its reasons, e.g. the device or dtype).
    """
    from pagedcore.attention import AttentionConfig
    from pagedcore.conformance.runner import resolve_backend

    cfg = AttentionConfig(head_size=LATENT + ROPE, block_size=16, device=device.type,
                          dtype="bfloat16" if device.type == "cuda" else "float32",
                          use_mla=True)
    out = []
    for name in names:
        try:
            cls = resolve_backend(name)
        except (KeyError, LookupError, TypeError) as exc:
            raise ValueError(str(exc).strip("'\"")) from exc
        if not cls.supports_mla:
            raise ValueError(f"backend {name!r} does not declare MLA; name an MLA backend "
                             f"(`pagedcore backends` lists them, e.g. triton_mla)")
        reasons = cls.validate_configuration(cfg)
        if reasons:
            raise ValueError(f"backend {name!r} cannot run this bench ({cfg.dtype}, "
                             f"{device.type}, latent {LATENT} + rope {ROPE}): "
                             + "; ".join(reasons))
        out.append(cls)
    return out


def _reference(query: torch.Tensor, cache: torch.Tensor, common: Any,
               device: torch.device) -> torch.Tensor:
    from pagedcore.kv_cache.spec import MLAAttentionSpec
    from pagedcore.reference.mla import MLAImpl, ReferenceMLABackend

    spec = MLAAttentionSpec(block_size=cache.shape[1], kv_lora_rank=LATENT, rope_head_dim=ROPE,
                            dtype="float32")
    meta = ReferenceMLABackend.get_builder_cls()(spec, ["l0"], device).build(common)
    ref = MLAImpl(NUM_HEADS, LATENT + ROPE, SCALE, kv_lora_rank=LATENT)
    q = query.float()
    return ref.forward(q, q, q, cache.float(), meta).float()


def backend_rows(
    device: torch.device,
    backends: Sequence[type[AttentionBackend]],
    *,
    quick: bool,
    copy_gbps: float | None,
    on_row: Callable[[dict[str, Any]], None] | None = None,
    dtype: torch.dtype | None = None,
) -> list[dict[str, Any]]:
    """Time every backend on every case (`QUICK_BACKEND_CASES` when `quick`) in `dtype`
    (default: bfloat16 on CUDA, float32 on CPU); a backend that fails on a case gets a row with
    ``error`` instead of the figures. The fastest correct row of each shape carries
    ``best_for_shape``."""
    import torch

    from pagedcore.bench.mla_kernel import _forward_fn, mark_best, measure_row
    from pagedcore.kv_cache.spec import MLAAttentionSpec

    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows: list[dict[str, Any]] = []
    for batch, context in QUICK_BACKEND_CASES if quick else BACKEND_CASES:
        cache, query, common = _decode_batch(batch, context, device, dtype)
        want = _reference(query, cache, common, device)
        kv_bytes = batch * context * (LATENT + ROPE) * cache.element_size()
        spec = MLAAttentionSpec(block_size=cache.shape[1], kv_lora_rank=LATENT,
                                rope_head_dim=ROPE, dtype=dtype)
        for cls in backends:
            row: dict[str, Any] = {"variant": cls.name, "backend": cls.name, "batch": batch,
                                   "context": context, "kv_bytes": kv_bytes}
            try:
                meta = cls.get_builder_cls()(spec, ["model.layers.0.self_attn"],
                                             device).build(common)
                impl_cls: Any = cls.get_impl_cls()
                impl = impl_cls(NUM_HEADS, LATENT + ROPE, SCALE, kv_lora_rank=LATENT)
            except Exception as exc:  # a backend that cannot plan a case is reported
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            else:
                measure_row(row, _forward_fn(impl, query, cache, meta), want, device,
                            copy_gbps=copy_gbps)
            rows.append(row)
            if on_row is not None:
                on_row(row)
        del cache, query, want
    mark_best(rows)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows
