"""The Triton backend's per-layer attention: cache write, then one launch per plan part."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
import torch

from pagedcore.attention import AttentionImpl
from pagedcore.attention.kv_quant import kv_cache_torch_dtype
from pagedcore_triton._env import interpreting, num_sms
from pagedcore_triton.capabilities import HEAD_SIZES, KV_CACHE_DTYPES
from pagedcore_triton.launch import PreparedLaunch
from pagedcore_triton.metadata import TritonAttentionMetadata
from pagedcore_triton.plan import LaunchPart, TileConfig, context_split

if TYPE_CHECKING:
    from pagedcore_triton.cascade import CascadePlan

__all__ = ["TritonAttentionImpl"]

_DTYPES = {torch.float16, torch.bfloat16, torch.float32}


class TritonAttentionImpl(AttentionImpl[TritonAttentionMetadata]):
    """One attention layer over the paged cache ``[2, num_blocks, block_size, Hkv, D]``.

    See `pagedcore.attention.AttentionImpl` for the parameters. Raises ValueError for a head
    size, KV-cache dtype or soft-cap the kernels do not serve. With an fp8 ``kv_cache_dtype``
    the cache is ``float8_e4m3fn`` / ``float8_e5m2``, quantized by the cache-write kernel
    with this layer's ``k_scale`` / ``v_scale`` and dequantized in the attention kernels.
    """

    def check_supported(self) -> None:
        sizes = HEAD_SIZES
        if self.head_size not in sizes:
            raise ValueError(
                f"the triton backend does not serve head size {self.head_size} "
                f"(supports {', '.join(map(str, sizes))}); pick another backend"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"the triton backend stores the KV cache as "
                f"{', '.join(KV_CACHE_DTYPES)}, got "
                f"kv_cache_dtype {self.kv_cache_dtype!r}"
            )

    def setup(self) -> None:
        #: The (cache, query) properties `_check` last accepted.
        self._checked: tuple[Any, ...] | None = None
        self._features = (
            self.alibi_slopes is not None,
            self.sliding_window is not None,
            self.logits_soft_cap is not None,
            self.kv_fp8,
            self.sinks is not None,
        )

    def _check(self, query: torch.Tensor, kv_cache: torch.Tensor) -> None:
        # A layer sees the same cache tensor and query dtype every step (twice a step: the
        # cache write and the attention): check them once, not per call (issue 22).
        seen = (kv_cache.data_ptr(), kv_cache.shape, kv_cache.stride(), kv_cache.dtype,
                query.dtype, query.is_cuda)
        if seen == self._checked:
            return
        self._check_inputs(query, kv_cache)
        self._checked = seen

    def _check_inputs(self, query: torch.Tensor, kv_cache: torch.Tensor) -> None:
        if query.device.type == "cpu" and not interpreting():
            raise ValueError(
                "the triton backend got CPU tensors; it runs on CUDA tensors, or on CPU tensors "
                "only when TRITON_INTERPRET=1 was set before pagedcore_triton was imported"
            )
        if query.dtype not in _DTYPES:
            raise ValueError(f"query dtype {query.dtype} is not float16, bfloat16 or float32")
        expected = (self.num_kv_heads, self.head_size)
        if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or tuple(kv_cache.shape[3:]) != expected:
            raise ValueError(
                f"kv_cache has shape {tuple(kv_cache.shape)}; expected "
                f"(2, num_blocks, block_size, {self.num_kv_heads}, {self.head_size}) as "
                "TritonAttentionBackend.get_kv_cache_shape gives"
            )
        expected_dtype = kv_cache_torch_dtype(self.kv_cache_dtype, query.dtype)
        if kv_cache.dtype != expected_dtype:
            raise ValueError(
                f"kv_cache dtype {kv_cache.dtype} does not match this layer's kv_cache_dtype "
                f"{self.kv_cache_dtype!r} with {query.dtype} queries (expected {expected_dtype})"
            )
        if not kv_cache.is_contiguous():
            raise ValueError("kv_cache must be contiguous")

    def do_kv_cache_update(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Scatter ``key``/``value`` ``[T, Hkv, D]`` into `kv_cache` at `slot_mapping` ``[T]``
        int64 (``-1`` skipped)."""
        self._check(key, kv_cache)
        from pagedcore_triton.ops import write_kv_cache

        num_tokens = min(key.shape[0], slot_mapping.shape[0])
        scales = self.kv_scales_on(kv_cache.device) if self.kv_fp8 else None
        if num_tokens != key.shape[0]:
            key, value = key[:num_tokens], value[:num_tokens]
        write_kv_cache(key, value, kv_cache, slot_mapping, kv_scales=scales)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
        *,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention for the step's ``[T, Hq, D]`` queries over the paged cache (which already
        holds this step's K/V). Returns ``[T, Hq, D]``.

        `key` / `value` ``[T, Hkv, D]`` (this step's own K/V, the rows written to the cache)
        are read only by prefill parts planned for the Hopper kernel
        (`LaunchPart.tma_prefill`); the other parts, and layers that kernel does not serve
        (`plan_tma.tma_layer_reason`), read the cache."""
        self._check(query, kv_cache)
        from pagedcore_triton.ops import run_launch

        if query.stride(-1) != 1:
            query = query.contiguous()
        if output is None:
            output = torch.empty_like(query)
        elif output.stride(-1) != 1:
            raise ValueError("output must have a contiguous last dimension")
        slopes = self.alibi_slopes_on(query.device)
        sinks = self.sinks_on(query.device)
        scales = self.kv_scales_on(query.device) if self.kv_fp8 else None
        if (metadata.cascade is not None and slopes is None and self.sliding_window is None
                and sinks is None and not self.kv_fp8 and self._cascade_fits(metadata.cascade)):
            self._forward_cascade(query, kv_cache, metadata, output)
            return output
        # The first layer of a step prepares each launch; the others reuse it (no device reads,
        # so this also holds under CUDA-graph capture and replay).
        shape_key = (query.shape[1], query.dtype, kv_cache.shape, self._features)
        for i, part in enumerate(metadata.parts):
            if part.context_segments > 1:
                part = self._context_split(metadata, i, part, query, kv_cache)
            if part.tma_prefill and self._tma_serves(part, query, key, value):
                self._forward_tma(i, part, query, key, value, kv_cache, metadata, output)
                continue
            launch = self._prepared(
                metadata, (i, shape_key), part, query, kv_cache, seq_lens=metadata.seq_lens,
                block_table=metadata.block_table, use_alibi=slopes is not None,
                sliding_window=self.sliding_window, kv_fp8=self.kv_fp8,
                use_sinks=sinks is not None,
            )
            run_launch(
                launch,
                query,
                kv_cache,
                output,
                scale=self.scale,
                alibi_slopes=slopes,
                sliding_window=self.sliding_window,
                logits_soft_cap=self.logits_soft_cap,
                kv_scales=scales,
                sinks=sinks,
            )
        return output

    def _tma_serves(
        self, part: LaunchPart, query: torch.Tensor, key: torch.Tensor | None,
        value: torch.Tensor | None,
    ) -> bool:
        """Whether this layer runs `part` on the Hopper prefill kernel (`plan_tma`)."""
        from pagedcore_triton.plan_tma import tma_layer_reason

        plain = not any(self._features)
        return tma_layer_reason(query, key, value, token_end=part.token_end, plain=plain,
                                interpreting=interpreting()) is None

    def _forward_tma(
        self,
        index: int,
        part: LaunchPart,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
        output: torch.Tensor,
    ) -> None:
        """`part` on the Hopper prefill kernel: own K/V from `key` / `value`, prefix paged."""
        from pagedcore_triton.ops_tma import prepare_tma, run_tma

        assert key is not None and value is not None
        cache_key = ("tma", index, query.shape[1], query.dtype, kv_cache.shape)
        launch: PreparedLaunch | None = metadata.launches.get(cache_key)
        if launch is None:
            launch = prepare_tma(
                part, num_heads=query.shape[1], dtype=query.dtype,
                kv_cache_shape=tuple(kv_cache.shape), query_start_loc=metadata.query_start_loc,
                seq_lens=metadata.seq_lens, block_table=metadata.block_table,
                causal=metadata.causal,
            )
            metadata.launches[cache_key] = launch
        run_tma(launch, query, key, value, kv_cache, output, scale=self.scale)

    def _cascade_fits(self, plan: CascadePlan) -> bool:
        """The step's suffix launch splits (its partials go to `cascade_merge_kernel`: a
        captured mixed cascade) or stays within `cascade.MAX_SUFFIX_ROWS` query rows per KV
        head with the prefix merge fused in (else the plain plan serves the step)."""
        from pagedcore_triton.cascade import MAX_SUFFIX_ROWS

        part = plan.suffix_part
        return bool(part.num_segments > 1
                    or part.max_query_len * self.num_queries_per_kv <= MAX_SUFFIX_ROWS)

    def _forward_cascade(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
        output: torch.Tensor,
    ) -> None:
        """The step through `pagedcore_triton.cascade` (shared prefix once, suffixes, merge)."""
        from pagedcore_triton.cascade import run_cascade, suffix_tiles

        plan = metadata.cascade
        assert plan is not None
        key = ("cascade", query.shape[1], query.dtype, kv_cache.shape, self._features)
        launch = self._prepared(
            metadata, key, plan.suffix_part, query, kv_cache, seq_lens=plan.suffix_seq_lens,
            block_table=plan.suffix_table, use_alibi=False, sliding_window=None,
            tiles=suffix_tiles(plan.suffix_part, num_queries_per_kv=self.num_queries_per_kv,
                               head_size=self.head_size, dtype=query.dtype),
        )
        run_cascade(plan, launch, query, kv_cache, output, scale=self.scale,
                    logits_soft_cap=self.logits_soft_cap)

    def _context_split(
        self, metadata: TritonAttentionMetadata, index: int, part: LaunchPart,
        query: torch.Tensor, kv_cache: torch.Tensor,
    ) -> LaunchPart:
        """`part` with the split-KV segments its grid leaves room for (`context_split`: up to
        ``part.context_segments``, one program per SM at most; the grid depends on the query
        heads). Decided by the step's first layer for these heads and reused."""
        key = ("context_split", index, query.shape[1], query.dtype, kv_cache.dtype)
        resolved: LaunchPart | None = metadata.launches.get(key)
        if resolved is None:
            segments = context_split(
                part, num_heads=query.shape[1], num_kv_heads=kv_cache.shape[3],
                head_size=kv_cache.shape[4], itemsize=query.dtype.itemsize,
                kv_itemsize=kv_cache.dtype.itemsize, num_sms=num_sms(query.device),
                interpreting=interpreting(),
            )
            resolved = part
            if segments > 1:
                resolved = attrs.evolve(part, num_segments=segments, tma_prefill=False,
                                        context_segments=1)
            metadata.launches[key] = resolved
        return resolved

    def _prepared(
        self,
        metadata: TritonAttentionMetadata,
        key: tuple[Any, ...],
        part: LaunchPart,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        *,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        use_alibi: bool,
        sliding_window: int | None,
        kv_fp8: bool = False,
        use_sinks: bool = False,
        tiles: TileConfig | None = None,
    ) -> PreparedLaunch:
        """`part`'s launch for this layer shape: prepared by the step's first layer, then
        reused (no device reads, so this also holds under CUDA-graph capture and replay)."""
        from pagedcore_triton.ops import prepare_launch

        launch: PreparedLaunch | None = metadata.launches.get(key)
        if launch is None:
            launch = prepare_launch(
                part,
                query_shape=(query.shape[0], query.shape[1], query.shape[2]),
                dtype=query.dtype,
                kv_cache_shape=tuple(kv_cache.shape),
                query_start_loc=metadata.query_start_loc,
                seq_lens=seq_lens,
                block_table=block_table,
                causal=metadata.causal,
                use_alibi=use_alibi,
                sliding_window=sliding_window,
                logits_soft_cap=self.logits_soft_cap,
                kv_fp8=kv_fp8,
                use_sinks=use_sinks,
                tiles=tiles,
            )
            metadata.launches[key] = launch
        return launch
