"""The per-layer cuda_paged attention: cache write, decode kernel, prefill kernel."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from pagedcore.attention.backend import AttentionImpl
from pagedcore_cuda_paged._ext import load_ops
from pagedcore_cuda_paged.metadata import CudaPagedMetadata
from pagedcore_cuda_paged.plan import (
    DecodePass,
    capture_span_bound,
    decode_plan,
)

if TYPE_CHECKING:
    import torch

__all__ = ["SUPPORTED_HEAD_SIZES", "CudaPagedImpl"]

#: Head sizes compiled into csrc/ (decode.cuh / prefill.cuh dispatch).
SUPPORTED_HEAD_SIZES = (64, 80, 96, 112, 128, 256)
_SMEM_FALLBACK = 48 * 1024


def _smem_limit(device: torch.device) -> int:
    import torch

    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "shared_memory_per_block_optin", _SMEM_FALLBACK))


def _aligned_rows(t: torch.Tensor) -> bool:
    """Unit stride in head_size and 16-byte aligned rows, as the kernels' vector loads need."""
    e = t.element_size()
    return (
        t.stride(2) == 1
        and (t.stride(0) * e) % 16 == 0
        and (t.stride(1) * e) % 16 == 0
        and t.data_ptr() % 16 == 0
    )


def _tiles64(metadata: CudaPagedMetadata, which: int, tiles: torch.Tensor) -> torch.Tensor:
    """`tiles` (``[N, 2]`` int32 (request, first row) of ``metadata.prefill_rows``-row tiles)
    as 64-row tiles for `prefill_fp8`: each 128-row tile becomes rows r and r + 64 (a tile
    past the request's last row is a no-op in the kernel), made on the device without a host
    read and kept in ``metadata.launches`` for the other layers."""
    import torch

    if metadata.prefill_rows == 64:
        return tiles
    key = ("fp8_tiles64", which)
    cached = metadata.launches.get(key)
    if cached is None:
        assert metadata.prefill_rows % 64 == 0
        n = metadata.prefill_rows // 64
        parts = [tiles + torch.tensor([0, 64 * j], dtype=tiles.dtype, device=tiles.device)
                 for j in range(n)]
        cached = torch.stack(parts, dim=1).reshape(-1, 2).contiguous()
        metadata.launches[key] = cached
    result: torch.Tensor = cached
    return result


class CudaPagedImpl(AttentionImpl[CudaPagedMetadata]):
    """One layer over the cuda_paged cache (see `pagedcore_cuda_paged.layout`).

    Parameters are `AttentionImpl`'s; `head_size` must be one of `SUPPORTED_HEAD_SIZES`.
    `kv_cache_dtype` ``"fp8_e4m3"`` / ``"fp8_e5m2"``: the cache write quantizes with the layer's
    scales (`cache_write_fp8`), decode runs the grouped tensor-core kernel (fp16 / bf16, head
    sizes 64-128; else the per-head CUDA-core one) and prefill the 64-row WMMA kernel over the
    fp8 cache (`decode_fp8` / `prefill_fp8`, dequantizing inside
    the kernel); block sizes 16 and 32 (the layout packs 16 fp8 elements per vector).
    """

    def check_supported(self) -> None:
        if self.head_size not in SUPPORTED_HEAD_SIZES:
            raise ValueError(
                f"cuda_paged has kernels for head sizes {SUPPORTED_HEAD_SIZES}, not "
                f"{self.head_size}; choose another backend (pagedcore select --head-size ...)"
            )

    def _block_size(self, kv_cache: torch.Tensor) -> int:
        per_block = self.num_kv_heads * self.head_size
        if kv_cache.dim() != 3 or kv_cache.shape[0] != 2 or kv_cache.shape[2] % per_block:
            raise ValueError(
                f"kv_cache shape {tuple(kv_cache.shape)} is not (2, num_blocks, "
                f"{per_block} * block_size); allocate it with CudaPagedBackend.get_kv_cache_shape"
            )
        return int(kv_cache.shape[2]) // per_block

    def do_kv_cache_update(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Scatter ``[T, Hkv, D]`` K/V into the cache through `slot_mapping` (``-1`` skipped)."""
        import torch

        n = key.shape[0]
        slots = slot_mapping[:n].to(torch.int64).contiguous()
        if self.kv_fp8:
            k_scale, v_scale = self.kv_scales_on(key.device)
            load_ops().cache_write_fp8(key, value, kv_cache, slots, self._block_size(kv_cache),
                                       k_scale, v_scale)
            return
        load_ops().cache_write(key, value, kv_cache, slots, self._block_size(kv_cache))

    def _partition_buffers(self, launch: Any, num_decodes: int, device: torch.device
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A partitioned decode's fp32 scratch: partial outputs, then the max logits and exp
        sums of each (request, head, partition); empty tensors for a single pass."""
        import torch

        if launch.mode is DecodePass.PARTITIONED:
            rows = num_decodes * self.num_heads * launch.max_partitions
            tmp = torch.empty(rows * self.head_size, dtype=torch.float32, device=device)
            stats = torch.empty(2, rows, dtype=torch.float32, device=device)
            return tmp, stats[0], stats[1]
        empty = torch.empty(0, dtype=torch.float32, device=device)
        return empty, empty, empty

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: CudaPagedMetadata,
        *,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of ``[T, Hq, D]`` queries over the paged cache (see `AttentionImpl`)."""
        import torch

        ops = load_ops()
        block_size = self._block_size(kv_cache)
        if block_size != metadata.block_size:
            raise ValueError(
                f"kv_cache holds blocks of {block_size} tokens but the plan was built for "
                f"{metadata.block_size}"
            )
        if not _aligned_rows(query):
            query = query.contiguous()
        out = output if output is not None and _aligned_rows(output) else torch.empty_like(query)
        alibi = self.alibi_slopes_on(query.device)
        cap = 0.0 if self.logits_soft_cap is None else float(self.logits_soft_cap)
        window = 0 if self.sliding_window is None else self.sliding_window
        common = (metadata.block_table, metadata.seq_lens, metadata.query_start_loc)

        if self.kv_fp8:
            self._forward_fp8(query, kv_cache, metadata, out, block_size)
            if output is not None and out is not output:
                output.copy_(out)
                return output
            return out

        if metadata.num_decodes:
            launch = decode_plan(
                metadata.decode_seq_lens, num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads, head_size=self.head_size,
                block_size=block_size, sliding_window=self.sliding_window,
                policy=metadata.policy, smem_limit=_smem_limit(query.device),
                is_float32=query.element_size() == 4,
                max_span=None if metadata.decode_max_seq_len is None else capture_span_bound(
                    metadata.decode_max_seq_len, block_size=block_size,
                    sliding_window=self.sliding_window),
            )
            tmp, max_logits, exp_sums = self._partition_buffers(
                launch, metadata.num_decodes, query.device)
            ops.decode(
                out, query, kv_cache, *common, metadata.decode_reqs, block_size,
                self.num_kv_heads, self.scale, cap, alibi, window, launch.partition_size,
                launch.max_partitions, launch.grouped, tmp, max_logits, exp_sums,
                launch.kernel_code, launch.unroll,
            )
        if metadata.num_prefill_tiles:
            ops.prefill(
                out, query, kv_cache, *common, metadata.prefill_tiles, block_size,
                self.num_kv_heads, self.scale, cap, alibi, window, metadata.causal,
                metadata.prefill_variant, metadata.prefill_rows,
            )
        if metadata.handoff_parts:
            if self._hopper_serves(query, key, value, metadata):
                self._run_handoff(query, key, value, kv_cache, metadata, out, block_size)
            else:
                assert metadata.handoff_tiles is not None
                ops.prefill(
                    out, query, kv_cache, *common, metadata.handoff_tiles, block_size,
                    self.num_kv_heads, self.scale, cap, alibi, window, metadata.causal,
                    metadata.prefill_variant, metadata.prefill_rows,
                )
        if output is not None and out is not output:
            output.copy_(out)
            return output
        return out

    def _forward_fp8(
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: CudaPagedMetadata,
        out: torch.Tensor, block_size: int,
    ) -> None:
        """The step over an fp8 cache: `decode_fp8` (the grouped tensor-core kernel for fp16 /
        bf16 queries and head sizes 64-128, else the per-head CUDA-core one; one pass or
        partitioned) for the decodes, `prefill_fp8` (64-row tiles) for every other request,
        handed-off prompts included (triton's Hopper kernel takes no fp8 cache)."""

        ops = load_ops()
        alibi = self.alibi_slopes_on(query.device)
        cap = 0.0 if self.logits_soft_cap is None else float(self.logits_soft_cap)
        window = 0 if self.sliding_window is None else self.sliding_window
        k_scale, v_scale = self.kv_scales_on(query.device)
        common = (metadata.block_table, metadata.seq_lens, metadata.query_start_loc)
        if metadata.num_decodes:
            launch = decode_plan(
                metadata.decode_seq_lens, num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads, head_size=self.head_size,
                block_size=block_size, sliding_window=self.sliding_window,
                # MMA (the grouped tensor-core decode, widening fp8 in registers) where it
                # applies, else the per-head CUDA-core kernel (fp8 has no grouped CLASSIC).
                policy=attrs.evolve(metadata.policy, group_heads=False),
                smem_limit=_smem_limit(query.device),
                is_float32=query.element_size() == 4,
                max_span=None if metadata.decode_max_seq_len is None else capture_span_bound(
                    metadata.decode_max_seq_len, block_size=block_size,
                    sliding_window=self.sliding_window),
            )
            tmp, max_logits, exp_sums = self._partition_buffers(
                launch, metadata.num_decodes, query.device)
            ops.decode_fp8(
                out, query, kv_cache, *common, metadata.decode_reqs, block_size,
                self.num_kv_heads, self.scale, cap, alibi, window, launch.partition_size,
                launch.max_partitions, tmp, max_logits, exp_sums, k_scale, v_scale,
                launch.kernel_code,
            )
        for i, tiles in enumerate((metadata.prefill_tiles, metadata.handoff_tiles)):
            if tiles is None or tiles.numel() == 0:
                continue
            ops.prefill_fp8(
                out, query, kv_cache, *common, _tiles64(metadata, i, tiles), block_size,
                self.num_kv_heads, self.scale, cap, alibi, window, metadata.causal,
                k_scale, v_scale,
            )

    def _hopper_serves(
        self, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
        metadata: CudaPagedMetadata,
    ) -> bool:
        """Whether this layer runs the handed-off prompts on triton's Hopper kernel
        (`pagedcore_cuda_paged.handoff`; `pagedcore_triton.plan_tma.tma_layer_reason`)."""
        from pagedcore_triton._env import interpreting
        from pagedcore_triton.plan_tma import tma_layer_reason

        plain = (self.alibi_slopes is None and self.sliding_window is None
                 and self.logits_soft_cap is None and self.sinks is None)
        token_end = max(p.token_end for p in metadata.handoff_parts)
        return tma_layer_reason(query, key, value, token_end=token_end, plain=plain,
                                interpreting=interpreting()) is None

    def _run_handoff(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        kv_cache: torch.Tensor, metadata: CudaPagedMetadata, out: torch.Tensor,
        block_size: int,
    ) -> None:
        """The handed-off prompts on triton's Hopper kernel: it reads their keys and values
        from `key` / `value` (no cached context, so never cuda_paged's cache)."""
        from pagedcore_triton.ops_tma import prepare_tma, run_tma

        # The kernel reads the cache only for a cached context (none here); the shape it is
        # given is triton's view of as many elements, for its (unused) strides.
        shape = (2, int(kv_cache.shape[1]), block_size, self.num_kv_heads, self.head_size)
        for i, part in enumerate(metadata.handoff_parts):
            cache_key = ("tma", i, query.shape[1], query.dtype, shape)
            launch = metadata.launches.get(cache_key)
            if launch is None:
                launch = prepare_tma(
                    part, num_heads=query.shape[1], dtype=query.dtype, kv_cache_shape=shape,
                    query_start_loc=metadata.query_start_loc, seq_lens=metadata.seq_lens,
                    block_table=metadata.block_table, causal=metadata.causal,
                )
                metadata.launches[cache_key] = launch
            run_tma(launch, query, key, value, kv_cache, out, scale=self.scale)
