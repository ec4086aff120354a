"""Runs one scheduled step on a transformers model through the selected attention backends."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from pagedcore.engine.models import attention_hook
from pagedcore.engine.models.support import output_logit_scale
from pagedcore.engine.runner.backend_setup import backend_call, checked_kv_cache_shape
from pagedcore.engine.runner.cascade_graphs import CascadeDecodeGraphs
from pagedcore.engine.runner.cascade_mixed_graphs import CascadeMixedGraphs
from pagedcore.engine.runner.cascade_plan import CascadePlanner
from pagedcore.engine.runner.cuda_graph import (
    DecodeGraphs,
)
from pagedcore.engine.runner.graph_routing import GraphRouting
from pagedcore.engine.runner.input_batch import InputBatch, StepInputs
from pagedcore.engine.runner.mixed_graphs import (
    MixedGraphs,
)
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
    from pagedcore.engine.scheduling.scheduler import ScheduledRequest

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


class ModelRunner(GraphRouting):
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
    kv_cache_dtype:
        ``"auto"`` or an fp8 name; with fp8 the KV-cache specs must carry the fp8 dtype (their
        page sizes follow it), and each layer's K/V scales are computed on the first prefill
        (`attention_hook.KVScaleCalibration`) unless `kv_scales` gives them.
    kv_scales:
        Per layer index ``(k_scale, v_scale)`` from the checkpoint (fp8 only), or None.
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
        kv_cache_dtype: str = "auto",
        kv_scales: dict[int, tuple[float, float]] | None = None,
    ) -> None:
        from pagedcore.engine.models.fused_attention import swap_fused_attention
        from pagedcore.engine.models.fused_decoder import (
            FusedDecoderLayer,
            swap_fused_decoder_layers,
        )
        from pagedcore.engine.models.fused_ops import (
            fused_kernels_disabled_reason,
            fused_kinds_setting,
            swap_fused_modules,
        )
        from pagedcore.engine.models.mla_attention import mla_impl_kwargs, swap_mla_attention
        from pagedcore.engine.models.rope import pin_longrope
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
        #: Phi-3 longrope frequencies fixed from max_model_len (not per step and batch).
        self.pinned_rope = pin_longrope(model, max_model_len)
        #: Why transformers' norms and MLPs were kept (None: fused kernels swapped in).
        self.fused_kernels_disabled_reason = fused_kernels_disabled_reason(device)
        #: Modules replaced by fused Triton kernels, per kind (empty when disabled).
        self.fused_kernels: dict[str, int] = {}
        if self.fused_kernels_disabled_reason is None:
            kinds = fused_kinds_setting()
            self.fused_kernels = swap_fused_modules(model, kinds=kinds)
            if "rotary" in kinds:
                self.fused_kernels.update(swap_fused_attention(model, fuse_qkv="qkv" in kinds))
            if "add_rms_norm" in kinds:
                self.fused_kernels["add_rms_norm"] = swap_fused_decoder_layers(
                    model, down_add="down_add" in kinds)
                if "down_add" in kinds:
                    self.fused_kernels["down_add"] = sum(
                        1 for m in model.modules()
                        if isinstance(m, FusedDecoderLayer) and m.down_add)
        self.base_model = getattr(model, model.base_model_prefix)
        self.lm_head: Any = model.get_output_embeddings()  # type: ignore[no-untyped-call]
        self.final_logit_softcap: float | None = getattr(config, "final_logit_softcapping", None)
        # Cohere's logit_scale, Granite's 1 / logits_scaling: the model's forward applies it
        # after lm_head, which the engine calls itself.
        self.logit_scale = output_logit_scale(config)
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
                kv_cache_dtype=kv_cache_dtype,
                has_sink=any(self._sinks_of(layer_index(n)) is not None
                             for n in group.layer_names),
            )
            self.backends.append(chosen)
            builder_cls = backend_call(chosen, "get_builder_cls()", chosen.get_builder_cls)
            self.builders.append(backend_call(chosen, "building its metadata builder",
                                              builder_cls, spec, group.layer_names, device))

        #: Shared prefixes per step and whether to cascade (`pagedcore.attention.cascade`).
        self.cascade = CascadePlanner(kv_cache_config.groups, self.backends)
        self.kv_caches = self._allocate_kv_caches()
        self.layers: dict[int, attention_hook.LayerBinding] = {}
        if num_heads is None:
            num_heads = int(config.num_attention_heads)
        for g, group in enumerate(kv_cache_config.groups):
            spec = group.spec
            window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
            impl_cls = backend_call(self.backends[g], "get_impl_cls()",
                                    self.backends[g].get_impl_cls)
            for name in group.layer_names:
                idx = layer_index(name)
                module = self._attention_module(idx)
                impl = backend_call(
                    self.backends[g], f"building the impl of layer {idx}", impl_cls,
                    num_heads,
                    spec.head_size,
                    float(module.scaling),
                    num_kv_heads=spec.num_kv_heads,
                    sliding_window=window,
                    logits_soft_cap=soft_cap,
                    kv_cache_dtype=kv_cache_dtype,
                    sinks=self._sinks_of(idx),
                    **mla_impl_kwargs(spec),
                )
                calibration = None
                if kv_cache_dtype != "auto" and kv_scales is not None:
                    impl.set_kv_scales(*kv_scales[idx])
                elif kv_cache_dtype != "auto":
                    calibration = attention_hook.KVScaleCalibration(impl.kv_cache_dtype,
                                                                    layer=idx)
                self.layers[idx] = attention_hook.LayerBinding(
                    impl, self.kv_caches[name], g, calibration
                )
        #: ``"auto"`` or the fp8 name every layer's cache is stored in.
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_scales_source = "checkpoint" if kv_scales is not None else "first prefill"
        self.input_batch = InputBatch(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            block_sizes=[g.spec.block_size for g in kv_cache_config.groups],
            device=device,
            decode_threshold=min(b.reorder_batch_threshold for b in self.builders),
        )
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        #: Captured mixed/prefill-step graphs per token bucket (None: such steps run eagerly).
        self.mixed_graphs: MixedGraphs | None = None
        #: Why mixed steps run eagerly (None while mixed graphs are in use).
        self.mixed_graphs_disabled_reason: str | None = "not enabled"
        #: Captured decode graphs (None: every step runs eagerly).
        self.graphs: DecodeGraphs | None = None
        #: Each decode bucket's captured plans (one per KV-cache group), for `prepare_replay`.
        self._graph_plans: dict[int, tuple[Any, ...]] = {}
        #: Why decode steps run eagerly (None while graphs are in use).
        self.cudagraph_disabled_reason: str | None = "not enabled"
        #: Decode graphs whose attention cascades over a shared prefix (captured on first
        #: use; None: shared-prefix decode steps replay the plain graph or run eagerly).
        self.cascade_graphs: CascadeDecodeGraphs | None = None
        #: Mixed-step graphs whose attention cascades (captured on first use; None: a
        #: shared-prefix mixed step replays the plain mixed graph or cascades eagerly).
        self.cascade_mixed_graphs: CascadeMixedGraphs | None = None
        #: A failed lazy capture turns a graph kind off instead of raising.
        self._graph_fallback = True
        #: Steps executed, by how (`STEP_PATHS`): what `LLM.stats()["cudagraph"]["step_paths"]`
        #: reports, so a user sees which steps missed a graph and why.
        self.step_paths: Counter[str] = Counter()

    @property
    def backend_names(self) -> list[str]:
        """The chosen backend of each KV-cache group."""
        return [b.name for b in self.backends]

    def _attention_module(self, idx: int) -> Any:
        return self.base_model.layers[idx].self_attn

    def _sinks_of(self, idx: int) -> Any:
        """Layer `idx`'s ``[Hq]`` attention-sink logits (GPT-OSS ``self_attn.sinks``), or None."""
        sinks = getattr(self._attention_module(idx), "sinks", None)
        return None if sinks is None else sinks.detach()

    @staticmethod
    def _kv_cache_dtype_name(spec_dtype: str) -> str:
        """The backend's ``cache_dtype`` for a spec dtype (fp8 torch names -> fp8 names)."""
        from pagedcore.attention.kv_quant import FP8_KV_CACHE_DTYPES

        for name, torch_name in FP8_KV_CACHE_DTYPES.items():
            if spec_dtype in (name, torch_name):
                return name
        return "auto"

    def _kv_scales_pending(self) -> bool:
        """Some fp8 layer still waits for its first prefill's scales: its step runs eagerly
        (the calibration reads the K/V on the host, which a graph replay never does)."""
        return any(b.calibration is not None and b.calibration.pending
                   for b in self.layers.values())

    def kv_scale_status(self) -> dict[str, Any]:
        """``{"kv_cache_dtype", "kv_scales"}``: where the fp8 scales come from (``"first
        prefill"``, or ``"pending (first prefill)"`` before it) and their ranges."""
        if self.kv_cache_dtype == "auto":
            return {"kv_cache_dtype": "auto", "kv_scales": None}
        pending = self._kv_scales_pending()
        ks = [b.impl.k_scale for b in self.layers.values()]
        vs = [b.impl.v_scale for b in self.layers.values()]
        return {"kv_cache_dtype": self.kv_cache_dtype, "kv_scales": {
            "source": "pending (first prefill)" if pending else self.kv_scales_source,
            "k_scale_range": [min(ks), max(ks)], "v_scale_range": [min(vs), max(vs)]}}

    def _allocate_kv_caches(self) -> dict[str, torch.Tensor]:
        import torch

        cfg = self.kv_cache_config
        layer_group = {n: g for g, grp in enumerate(cfg.groups) for n in grp.layer_names}

        def shape_of(name: str) -> tuple[tuple[int, ...], torch.dtype]:
            spec = cfg.groups[layer_group[name]].spec
            backend = self.backends[layer_group[name]]
            dtype = _torch_dtype(spec.dtype)
            what = "get_kv_cache_shape()"
            shape = backend_call(backend, what, backend.get_kv_cache_shape, cfg.num_blocks,
                                 spec.block_size, spec.num_kv_heads, spec.head_size,
                                 self._kv_cache_dtype_name(spec.dtype))
            need = cfg.num_blocks * spec.page_size_bytes // dtype.itemsize
            return checked_kv_cache_shape(backend, shape, min_elements=need, what=what), dtype

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

    # ---- CUDA graphs (the rest: `GraphRouting`) -----------------------------------------

    def _graph_forward(self, bucket: int) -> Callable[[], torch.Tensor]:
        """The forward a bucket's graph records, over the persistent buffers."""
        self.input_batch.write_padding(bucket)
        common = self.input_batch.graph_common(bucket)
        metadata = tuple(
            b.build_for_cudagraph_capture(c) for b, c in zip(self.builders, common, strict=True)
        )
        self._graph_plans[bucket] = metadata
        return self._forward_over(bucket, metadata)

    def _forward_over(self, bucket: int,
                      metadata: tuple[Any, ...]) -> Callable[[], torch.Tensor]:
        """The base model's forward over the persistent decode buffers of `bucket` with
        these per-group plans (what a decode or cascade graph records)."""
        import torch

        common = self.input_batch.graph_common(bucket)
        ctx = attention_hook.StepContext(
            layers=self.layers,
            metadata=metadata,
            slot_mappings=tuple(c.slot_mapping for c in common),
        )
        input_ids, positions = self.input_batch.graph_inputs(bucket)

        def forward() -> torch.Tensor:
            with torch.inference_mode():
                hidden: torch.Tensor = self._hidden(input_ids, positions, ctx)
            return hidden

        return forward

    # ---- the step -------------------------------------------------------------------------

    def prepare(
        self,
        scheduled: Sequence[ScheduledRequest],
        block_ids: Callable[[str], tuple[list[int], ...]],
        *,
        decode_graph: bool = True,
    ) -> StepInputs:
        """Flatten the step into tensors and per-group metadata (padded to a CUDA-graph
        bucket when the step is all single-token decodes and graphs are enabled; never with
        ``decode_graph=False``: a tensor-parallel worker follows rank 0's choice)."""
        shared, use = self.cascade.plan(scheduled, block_ids)
        bucket, use = self.route_step(scheduled, use, decode_graph)
        inputs = self.input_batch.prepare(scheduled, block_ids, pad_to=bucket)
        if not any(shared):
            return inputs
        common = tuple(
            attrs.evolve(c, common_prefix_len=p) for c, p in zip(inputs.common, shared,
                                                                  strict=True)
        )
        return attrs.evolve(inputs, common=common, cascade_prefix_lens=use)

    def _hidden(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: attention_hook.StepContext
    ) -> torch.Tensor:
        out = self.base_model(
            input_ids=input_ids.unsqueeze(0),
            position_ids=positions.unsqueeze(0),
            use_cache=False,
            pagedcore_ctx=ctx,
        )
        hidden: torch.Tensor = out.last_hidden_state[0]
        return hidden

    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """Run the model on a prepared step (replaying its bucket's graph when it has one).

        Returns
        -------
        torch.Tensor
            ``[S + Q, V]`` logits in the model's dtype (the sampler converts the rows that need
            float32; greedy rows take their argmax as they are): one row per entry of
            ``inputs.sample_rows``, then one per row of ``inputs.prompt_rows`` (Q = 0 without).
        """
        import torch

        with torch.inference_mode():
            hidden = self.replay_graph(inputs)
            if hidden is None:  # eagerly
                prefix = inputs.cascade_prefix_lens or (0,) * len(self.builders)
                metadata = tuple(
                    builder.build(common, common_prefix_len=p)
                    for builder, common, p in zip(self.builders, inputs.common, prefix,
                                                  strict=True)
                )
                ctx = attention_hook.StepContext(
                    layers=self.layers,
                    metadata=metadata,
                    slot_mappings=tuple(c.slot_mapping for c in inputs.common),
                )
                hidden = self._hidden(inputs.input_ids, inputs.positions, ctx)
            rows = inputs.logits_indices
            if inputs.prompt_rows is not None:
                rows = torch.cat([rows, inputs.prompt_rows.indices])
            logits: torch.Tensor = self.lm_head(hidden.index_select(0, rows))
            if self.logit_scale is not None:
                logits = logits * self.logit_scale
            cap = self.final_logit_softcap
            if cap is not None:
                logits = torch.tanh(logits / cap) * cap
        return logits


class _Alloc:
    """Stand-in for a `KVCacheTensor` when the config lists none (one tensor per layer)."""

    def __init__(self, *, shared_by: tuple[str, ...], size_bytes: int) -> None:
        self.shared_by = shared_by
        self.size_bytes = size_bytes
