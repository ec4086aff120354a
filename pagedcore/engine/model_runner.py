"""Runs one scheduled step on a transformers model through the selected attention backends."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pagedcore.engine import attention_hook
from pagedcore.engine.input_batch import InputBatch, StepInputs
from pagedcore.kv_cache.spec import (
    KVCacheConfig,
    KVCacheTensor,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from pagedcore.attention.backend import AttentionBackend, MetadataBuilder
    from pagedcore.engine.scheduler import ScheduledRequest

__all__ = ["ModelRunner", "layer_index"]

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_index(layer_name: str) -> int:
    """``"model.layers.3.self_attn"`` -> 3."""
    match = _LAYER_RE.search(layer_name + ".")
    if match is None:
        raise ValueError(f"cannot find a layer index in KV-cache layer name {layer_name!r}")
    return int(match.group(1))


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


class ModelRunner:
    """Owns the KV-cache tensors, the per-layer attention impls and the step inputs.

    Parameters
    ----------
    model:
        A causal LM whose ``config._attn_implementation`` will be set to ``"pagedcore"``.
    kv_cache_config:
        Block count, groups and tensors from `pagedcore.kv_cache.config.make_kv_cache_config`.
    device, dtype:
        Where and in which dtype the model runs.
    backend:
        Force a backend by name (else the selector picks per group).
    max_num_seqs, max_num_batched_tokens, max_model_len:
        Step limits (size the persistent buffers).
    num_heads:
        Query heads this process computes (None: the config's; tensor parallelism passes the
        rank's share).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        kv_cache_config: KVCacheConfig,
        device: torch.device,
        dtype: torch.dtype,
        backend: str | None,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        num_heads: int | None = None,
    ) -> None:
        from pagedcore.engine.mla_attention import mla_impl_kwargs, swap_mla_attention
        from pagedcore.plugins.selector import select_backend

        attention_hook.register()
        self.model = model
        self.device = device
        self.dtype = dtype
        self.kv_cache_config = kv_cache_config
        config = model.config
        model.set_attn_implementation(attention_hook.ATTN_IMPLEMENTATION)
        # DeepSeek-V2/V3: paged latent attention modules (no-op for other models).
        swap_mla_attention(model)
        self.base_model = getattr(model, model.base_model_prefix)
        self.lm_head: Any = model.get_output_embeddings()  # type: ignore[no-untyped-call]
        self.final_logit_softcap: float | None = getattr(config, "final_logit_softcapping", None)
        soft_cap: float | None = getattr(config, "attn_logit_softcapping", None)

        self.backends: list[type[AttentionBackend]] = []
        self.builders: list[MetadataBuilder[Any]] = []
        for group in kv_cache_config.groups:
            spec = group.spec
            window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
            chosen = select_backend(
                head_size=spec.head_size,
                dtype=dtype,
                block_size=spec.block_size,
                sliding_window=window,
                logits_soft_cap=soft_cap,
                use_mla=isinstance(spec, MLAAttentionSpec),
                device=device.type,
                backend=backend,
            )
            self.backends.append(chosen)
            self.builders.append(chosen.get_builder_cls()(spec, group.layer_names, device))

        self.kv_caches = self._allocate_kv_caches()
        self.layers: dict[int, attention_hook.LayerBinding] = {}
        if num_heads is None:
            num_heads = int(config.num_attention_heads)
        for g, group in enumerate(kv_cache_config.groups):
            spec = group.spec
            window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
            impl_cls = self.backends[g].get_impl_cls()
            for name in group.layer_names:
                idx = layer_index(name)
                module = self._attention_module(idx)
                impl = impl_cls(
                    num_heads,
                    spec.head_size,
                    float(module.scaling),
                    num_kv_heads=spec.num_kv_heads,
                    sliding_window=window,
                    logits_soft_cap=soft_cap,
                    **mla_impl_kwargs(spec),
                )
                self.layers[idx] = attention_hook.LayerBinding(impl, self.kv_caches[name], g)
        self.input_batch = InputBatch(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            block_sizes=[g.spec.block_size for g in kv_cache_config.groups],
            device=device,
            decode_threshold=min(b.reorder_batch_threshold for b in self.builders),
        )

    @property
    def backend_names(self) -> list[str]:
        """The chosen backend of each KV-cache group."""
        return [b.name for b in self.backends]

    def _attention_module(self, idx: int) -> Any:
        return self.base_model.layers[idx].self_attn

    def _allocate_kv_caches(self) -> dict[str, torch.Tensor]:
        import torch

        cfg = self.kv_cache_config
        layer_group = {n: g for g, grp in enumerate(cfg.groups) for n in grp.layer_names}

        def shape_of(name: str) -> tuple[tuple[int, ...], torch.dtype]:
            spec = cfg.groups[layer_group[name]].spec
            shape = self.backends[layer_group[name]].get_kv_cache_shape(
                cfg.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size
            )
            return shape, _torch_dtype(spec.dtype)

        caches: dict[str, torch.Tensor] = {}
        tensors: Sequence[KVCacheTensor | _Alloc] = cfg.tensors or tuple(
            _Alloc(shared_by=(n,), size_bytes=0) for n in layer_group
        )
        for tensor in tensors:
            sizes = [shape_of(n) for n in tensor.shared_by]
            need = max(math.prod(s) * d.itemsize for s, d in sizes)
            size = max(tensor.size_bytes, need)
            raw = torch.zeros(size, dtype=torch.uint8, device=self.device)
            for name, (shape, dtype) in zip(tensor.shared_by, sizes, strict=True):
                numel = math.prod(shape)
                caches[name] = raw[: numel * dtype.itemsize].view(dtype).view(shape)
        missing = set(layer_group) - set(caches)
        if missing:
            raise ValueError(f"KV-cache config backs no tensor for layers {sorted(missing)}")
        return caches

    def prepare(
        self,
        scheduled: Sequence[ScheduledRequest],
        block_ids: Callable[[str], tuple[list[int], ...]],
    ) -> StepInputs:
        """Flatten the step into tensors and per-group metadata."""
        return self.input_batch.prepare(scheduled, block_ids)

    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """Run the model on a prepared step.

        Returns
        -------
        torch.Tensor
            ``[S, V]`` float32 logits, one row per entry of ``inputs.sample_rows``.
        """
        import torch

        metadata = tuple(
            builder.build(common) for builder, common in zip(self.builders, inputs.common,
                                                             strict=True)
        )
        ctx = attention_hook.StepContext(
            layers=self.layers,
            metadata=metadata,
            slot_mappings=tuple(c.slot_mapping for c in inputs.common),
        )
        with torch.inference_mode():
            out = self.base_model(
                input_ids=inputs.input_ids.unsqueeze(0),
                position_ids=inputs.positions.unsqueeze(0),
                use_cache=False,
                pagedcore_ctx=ctx,
            )
            hidden = out.last_hidden_state[0].index_select(0, inputs.logits_indices)
            logits: torch.Tensor = self.lm_head(hidden)
            cap = self.final_logit_softcap
            if cap is not None:
                logits = torch.tanh(logits / cap) * cap
        return logits.float()


class _Alloc:
    """Stand-in for a `KVCacheTensor` when the config lists none (one tensor per layer)."""

    def __init__(self, *, shared_by: tuple[str, ...], size_bytes: int) -> None:
        self.shared_by = shared_by
        self.size_bytes = size_bytes
