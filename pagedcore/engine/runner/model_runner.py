"""Runs one scheduled step on a transformers model through the selected attention backends."""

from __future__ import annotations

import math
import re
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from pagedcore.engine.models import attention_hook
from pagedcore.engine.models.support import output_logit_scale
from pagedcore.engine.runner.cascade_graphs import CascadeDecodeGraphs
from pagedcore.engine.runner.cascade_mixed_graphs import CascadeMixedGraphs
from pagedcore.engine.runner.cascade_plan import CascadePlanner
from pagedcore.engine.runner.cuda_graph import (
    DecodeGraphs,
    GraphCapturer,
    capture_sizes,
    cudagraph_unsupported_reason,
)
from pagedcore.engine.runner.input_batch import InputBatch, StepInputs
from pagedcore.engine.runner.mixed_graphs import (
    MixedGraphs,
    enable_mixed_graphs,
    mixed_forward_over,
)
from pagedcore.engine.runner.prompt_rows import prompt_rows_wanted
from pagedcore.engine.scheduling.scheduler_types import DecodeBatch
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
        from pagedcore.engine.models.fused_decoder import swap_fused_decoder_layers
        from pagedcore.engine.models.fused_ops import (
            fused_kernels_disabled_reason,
            fused_kinds_setting,
            swap_fused_modules,
        )
        from pagedcore.engine.models.mla_attention import mla_impl_kwargs, swap_mla_attention
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
                self.fused_kernels["add_rms_norm"] = swap_fused_decoder_layers(model)
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
            self.builders.append(chosen.get_builder_cls()(spec, group.layer_names, device))

        #: Shared prefixes per step and whether to cascade (`pagedcore.attention.cascade`).
        self.cascade = CascadePlanner(kv_cache_config.groups, self.backends)
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
            shape = self.backends[layer_group[name]].get_kv_cache_shape(
                cfg.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size,
                self._kv_cache_dtype_name(spec.dtype),
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

    # ---- CUDA graphs ----------------------------------------------------------------------

    def enable_cudagraphs(
        self,
        *,
        sizes: Sequence[int] | None = None,
        capturer: GraphCapturer | None = None,
        capture_now: bool = True,
        fallback: bool = True,
    ) -> str | None:
        """Run uniform single-token decode steps as CUDA graphs, one per batch-size bucket.

        Parameters
        ----------
        sizes:
            Buckets (None: `capture_sizes` of ``max_num_seqs``); larger batches run eagerly.
        capturer:
            None: `CudaGraphCapturer` when the device is CUDA and every group's backend
            declares ``cudagraph_support >= UNIFORM_SINGLE_TOKEN_DECODE``. A given capturer
            (tests: `EagerCapturer`) skips those checks.
        capture_now:
            Capture every bucket now (largest first) instead of on first use.
        fallback:
            When a capture fails: serve eagerly with a warning (True), or raise (False: with
            tensor parallelism every rank must capture the same graphs, or their collectives
            stop meeting).

        Returns
        -------
        str or None
            Why graphs stay off (None: enabled); also kept in ``cudagraph_disabled_reason``.
        """
        automatic = capturer is None
        if capturer is None:
            reason = cudagraph_unsupported_reason(self.backends, self.device)
            if reason is not None:
                self.cudagraph_disabled_reason = reason
                return reason
            from pagedcore.engine.runner.cuda_graph import CudaGraphCapturer

            capturer = CudaGraphCapturer(self.device)
        limit = self.max_num_seqs
        chosen = [s for s in (capture_sizes(limit) if sizes is None else sizes) if s <= limit]
        if not chosen:
            raise ValueError(f"no capture size in {sizes} is <= max_num_seqs={limit}")
        self.graphs = DecodeGraphs(
            sizes=chosen, capturer=capturer, make_forward=self._graph_forward
        )
        self._graph_fallback = fallback
        cascading = [ok and b.supports_cascade_cudagraph
                     for ok, b in zip(self.cascade.eligible, self.backends, strict=True)]
        if any(cascading):
            self.cascade_graphs = CascadeDecodeGraphs(
                sizes=chosen, capturer=capturer, builders=self.builders, cascading=cascading,
                graph_common=self.input_batch.graph_common,
                write_padding=self.input_batch.write_padding,
                forward_over=self._forward_over, device=self.device,
            )
        self.cudagraph_disabled_reason = None
        # Mixed steps too, when every backend declares ALWAYS (captured first: the largest
        # graphs, whose pool memory the decode graphs then reuse).
        self.mixed_graphs, self.mixed_graphs_disabled_reason = enable_mixed_graphs(
            self, capturer=capturer, capture_now=capture_now, check_device=automatic,
            strict=not (automatic and fallback),
        )
        self._enable_cascade_mixed_graphs(capturer, cascading)
        if capture_now:
            try:
                self.graphs.capture_all()
            except Exception as exc:
                if not (automatic and fallback):
                    raise
                # A backend that declares support but cannot be captured: serve eagerly
                # (slower, still correct) and say why.
                self.graphs = None
                self.cascade_graphs = None
                self.cudagraph_disabled_reason = (
                    f"capture failed: {type(exc).__name__}: {exc}"[:500]
                )
                warnings.warn(
                    f"CUDA graphs disabled, decode steps run eagerly: "
                    f"{self.cudagraph_disabled_reason}",
                    RuntimeWarning,
                    stacklevel=2,
                )
                return self.cudagraph_disabled_reason
        return None

    def _enable_cascade_mixed_graphs(self, capturer: GraphCapturer,
                                     cascading: Sequence[bool]) -> None:
        """Set up (not capture) cascade mixed-step graphs over the mixed graphs' buffers for
        the groups whose decode graphs cascade and whose backend declares
        ``supports_cascade_mixed_cudagraph``."""
        mixed = self.mixed_graphs
        flags = [on and b.supports_cascade_mixed_cudagraph
                 for on, b in zip(cascading, self.backends, strict=True)]
        self.cascade_mixed_graphs = None
        if mixed is None or not any(flags):
            return
        buffers = mixed.buffers

        def forward_over(bucket: int, metadata: tuple[Any, ...]) -> Callable[[], torch.Tensor]:
            return mixed_forward_over(self, buffers, bucket, metadata)

        self.cascade_mixed_graphs = CascadeMixedGraphs(
            sizes=mixed.sizes, buffers=buffers, capturer=capturer, builders=self.builders,
            cascading=flags, forward_over=forward_over, device=self.device,
        )

    def release_graphs(self) -> None:
        """Free the captured decode and mixed-step graphs (steps run eagerly afterwards)."""
        for graphs in (self.graphs, self.mixed_graphs, self.cascade_graphs,
                       self.cascade_mixed_graphs):
            if graphs is not None:
                graphs.release()
        if self.graphs is not None or self.mixed_graphs is not None:
            self.cudagraph_disabled_reason = "graphs released"
            self.mixed_graphs_disabled_reason = "graphs released"
        self.graphs = None
        self.mixed_graphs = None
        self.cascade_graphs = None
        self.cascade_mixed_graphs = None
        self._graph_plans.clear()

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

    def _graph_bucket(self, scheduled: Sequence[ScheduledRequest]) -> int | None:
        if self.graphs is None or not scheduled:
            return None
        n = len(scheduled)
        if not isinstance(scheduled, DecodeBatch) and (
            [s.num_new_tokens for s in scheduled].count(1) != n
            # A one-token prompt chunk whose logits give a prompt logprob: the eager path
            # (`pagedcore.engine.distributed.plan.StepPlan.decode_graph` tells TP workers).
            or prompt_rows_wanted(scheduled)
        ):
            return None
        return self.graphs.bucket_for(n)

    def _capture_lazily(self, attr: str, bucket: int, kind: str, steps: str) -> bool:
        """Capture `bucket` of the cascade graphs in ``self.<attr>`` if not yet done. A
        capture that fails turns that kind off with a warning naming `kind` and what its
        `steps` do instead, unless graphs were enabled with ``fallback=False`` (tensor
        parallelism), which raises."""
        graphs = getattr(self, attr)
        assert graphs is not None
        try:
            graphs.capture(bucket)
        except Exception as exc:
            if not self._graph_fallback:
                raise
            graphs.release()
            setattr(self, attr, None)
            warnings.warn(
                f"{kind} disabled (capture of {graphs.bucket_unit} {bucket} failed: "
                f"{type(exc).__name__}: {exc}"[:400] + f"); {steps} replay the plain graph "
                "or cascade eagerly",
                RuntimeWarning, stacklevel=3,
            )
            return False
        return True

    def _capture_cascade_graph(self, bucket: int) -> bool:
        """Capture `bucket`'s cascade graph if not yet done (before the step's inputs land:
        a capture fills the buffers with padding); a failure turns cascade decode graphs off
        (shared-prefix decode steps then follow `against_graph`), see `_capture_lazily`."""
        return self._capture_lazily("cascade_graphs", bucket, "cascade decode graphs",
                                    "shared-prefix decode steps")

    def _cascade_graph_bucket(
        self, scheduled: Sequence[ScheduledRequest], use: tuple[int, ...], decode_graph: bool
    ) -> tuple[int | None, tuple[int, ...]]:
        """The decode bucket whose cascade graph serves this step, and the per-group prefix
        lengths it replays with (groups whose graph plan does not cascade get 0); ``(None,
        use)`` when no cascade graph applies (mixed steps, no decode graph, no group left
        cascading)."""
        graphs = self.cascade_graphs
        if graphs is None or not decode_graph:
            return None, use
        bucket = self._graph_bucket(scheduled)
        graph_use = tuple(p if on else 0 for p, on in zip(use, graphs.cascading, strict=True))
        if bucket is None or not any(graph_use):
            return None, use
        return bucket, graph_use

    def _capture_cascade_mixed(self, bucket: int) -> bool:
        """Capture `bucket`'s mixed cascade graph if not yet done; a failure turns mixed
        cascade graphs off (the step then cascades eagerly; later shared-prefix mixed steps
        follow `against_graph`), see `_capture_lazily`."""
        return self._capture_lazily("cascade_mixed_graphs", bucket,
                                    "cascade mixed-step graphs", "shared-prefix mixed steps")

    def _cascade_mixed_ready(self, inputs: StepInputs) -> bool:
        """A mixed cascade graph serves this prepared step, its bucket captured (now, on
        first use: the mixed buffers are loaded after the capture's padding)."""
        graphs = self.cascade_mixed_graphs
        bucket = None if graphs is None else graphs.cascade_bucket(inputs)
        # (cheapest check first: most steps cascade nothing)
        return (bucket is not None and not self._kv_scales_pending()
                and self._capture_cascade_mixed(bucket))

    def _mixed_graph_fits(self, scheduled: Sequence[ScheduledRequest]) -> bool:
        """A mixed-step graph's token bucket and request slots hold this step."""
        mixed = self.mixed_graphs
        if mixed is None or self._kv_scales_pending():
            return False
        tokens = (len(scheduled) if isinstance(scheduled, DecodeBatch)
                  else sum(s.num_new_tokens for s in scheduled))
        return 0 < tokens <= max(mixed.sizes) and len(scheduled) <= mixed.buffers.num_reqs

    def _graph_would_serve(self, scheduled: Sequence[ScheduledRequest],
                           decode_graph: bool) -> bool:
        """A decode or mixed-step graph would replay this step if it did not cascade."""
        if decode_graph and self._graph_bucket(scheduled) is not None:
            return True
        return self._mixed_graph_fits(scheduled)

    def _mixed_cascade_use(
        self, scheduled: Sequence[ScheduledRequest], use: tuple[int, ...], decode_graph: bool
    ) -> tuple[int, ...] | None:
        """The per-group prefix lengths a mixed cascade graph replays this step with (groups
        whose plan does not cascade get 0), or None when none serves it (no such graphs, a
        step a decode graph holds, no bucket fits, no group left cascading)."""
        graphs = self.cascade_mixed_graphs
        if graphs is None or (decode_graph and self._graph_bucket(scheduled) is not None):
            return None
        graph_use = tuple(p if on else 0 for p, on in zip(use, graphs.cascading, strict=True))
        if not any(graph_use) or not self._mixed_graph_fits(scheduled):
            return None
        return graph_use

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
        cascade_bucket = None
        if any(use):
            cascade_bucket, graph_use = self._cascade_graph_bucket(scheduled, use, decode_graph)
            if cascade_bucket is not None and not self._capture_cascade_graph(cascade_bucket):
                cascade_bucket = None
            mixed_use = (None if cascade_bucket is not None
                         else self._mixed_cascade_use(scheduled, use, decode_graph))
            if cascade_bucket is not None:
                use = graph_use  # the step replays its bucket's cascade graph
            elif mixed_use is not None:
                use = mixed_use  # the step replays its token bucket's mixed cascade graph
            elif self._graph_would_serve(scheduled, decode_graph):
                # An eager cascade plan follows this step's lengths: cascade only when the
                # reads it saves outweigh the lost replay.
                use = self.cascade.against_graph(use, len(scheduled))
        if cascade_bucket is not None:
            bucket: int | None = cascade_bucket
        else:
            bucket = None if any(use) or not decode_graph else self._graph_bucket(scheduled)
            if bucket is not None:
                assert self.graphs is not None
                self.graphs.capture(bucket)
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
            if inputs.cudagraph_bucket is not None:
                assert self.graphs is not None
                bucket = inputs.cudagraph_bucket
                if any(inputs.cascade_prefix_lens):
                    assert self.cascade_graphs is not None
                    self.step_paths["cascade graph"] += 1
                    hidden = self.cascade_graphs.replay_step(
                        bucket, inputs.cascade_prefix_lens, inputs.common)
                else:
                    self.step_paths["decode graph"] += 1
                    self.graphs.capture(bucket)
                    for builder, plan, common in zip(
                        self.builders, self._graph_plans[bucket], inputs.common, strict=True
                    ):
                        builder.prepare_replay(plan, common)
                    hidden = self.graphs.replay(bucket)
            elif self._cascade_mixed_ready(inputs):
                assert self.cascade_mixed_graphs is not None
                self.step_paths["cascade mixed graph"] += 1
                hidden = self.cascade_mixed_graphs.run(inputs)
            elif (
                not any(inputs.cascade_prefix_lens)
                and self.mixed_graphs is not None
                and not self._kv_scales_pending()  # a replay runs no calibration (Python)
                and self.mixed_graphs.bucket_for(inputs)
            ):
                self.step_paths["mixed graph"] += 1
                hidden = self.mixed_graphs.run(inputs)
            else:
                self.step_paths[self._eager_path(inputs)] += 1
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

    def _eager_path(self, inputs: StepInputs) -> str:
        """Why a step runs eagerly, as one of `STEP_PATHS`' ``eager (...)`` entries."""
        if any(inputs.cascade_prefix_lens):
            return "eager (cascade plan)"
        if self.mixed_graphs is None:
            return "eager (graphs off)" if self.graphs is None else "eager (no mixed-step graphs)"
        if self._kv_scales_pending():
            return "eager (fp8 scales pending)"
        return "eager (no bucket fits)"


#: How a step can run (`ModelRunner.step_paths` keys): a replayed decode, cascade-decode or
#: mixed-step graph, or eagerly because cascade attention planned it from the step's own
#: lengths, graphs are off (CPU, ``enforce_eager``, a backend without graph support), only
#: decode graphs exist and the step is not a decode batch they hold, a layer's fp8 scales
#: wait for the first prefill, or the step has more tokens or requests than the largest bucket.
STEP_PATHS = (
    "decode graph", "cascade graph", "mixed graph", "cascade mixed graph",
    "eager (cascade plan)", "eager (graphs off)",
    "eager (no mixed-step graphs)", "eager (fp8 scales pending)", "eager (no bucket fits)",
)


class _Alloc:
    """Stand-in for a `KVCacheTensor` when the config lists none (one tensor per layer)."""

    def __init__(self, *, shared_by: tuple[str, ...], size_bytes: int) -> None:
        self.shared_by = shared_by
        self.size_bytes = size_bytes
