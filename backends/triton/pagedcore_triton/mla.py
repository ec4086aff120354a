"""The Triton MLA backend: paged latent-cache attention with split-KV (kernels in `mla_kernels`).

Follows the MLA impl contract of `pagedcore.reference.mla`: cache ``[num_blocks, block_size,
L + R]``; ``do_kv_cache_update`` takes ``key`` ``[T, 1, L + R]``; ``forward`` takes the absorbed
query ``[T, H, L + R]`` and returns the latent output ``[T, H, L]``. Every token of a mixed batch
runs through the same per-token kernel (decodes and prefill tokens alike); the builder chooses
how many split-KV segments to use so that a small decode batch still fills the GPU.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import attrs
import torch

from pagedcore.attention import (
    AttentionImpl,
    CommonAttentionMetadata,
    MetadataBuilder,
)
from pagedcore.attention.mla import MLAAttentionBackend
from pagedcore.reference.mla import MLAImplBase, check_mla_cache_dtype, check_mla_write_args
from pagedcore_triton._env import interpreting, triton_unavailable_reason
from pagedcore_triton.mla_config import (
    DEFAULT_MLA_KERNEL,
    MERGE_WHOLE_ROW_PAIRS,
    MLA_KERNEL_CONFIGS,
    MLAKernelConfig,
    MLASplitRule,
    choose_mla_splits,
    merge_layout,
)

__all__ = [
    "DEFAULT_MLA_KERNEL",
    "MLA_KERNEL_CONFIGS",
    "MLAKernelConfig",
    "MLALaunch",
    "MLASplitRule",
    "TritonMLABackend",
    "TritonMLAImpl",
    "TritonMLAMetadata",
    "TritonMLAMetadataBuilder",
    "choose_mla_splits",
]


def _next_pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


#: ``PAGEDCORE_TRITON_MLA_FP8_CVT``: what an fp8 latent tile becomes for the MMAs with 16-bit
#: queries: ``f16`` (default: queries and tiles as float16; e4m3 -> f16 is one conversion)
#: or ``query`` (the query's dtype: bf16 goes through float32).
MLA_FP8_CVT_ENV = "PAGEDCORE_TRITON_MLA_FP8_CVT"


def fp8_converts_to_f16() -> bool:
    """Whether fp8 latent tiles enter the MMAs as float16 (`MLA_FP8_CVT_ENV`); a value other
    than ``f16`` / ``query`` is a ValueError naming the variable."""
    import os

    value = os.environ.get(MLA_FP8_CVT_ENV, "f16").strip().lower()
    if value not in ("f16", "query"):
        raise ValueError(f"{MLA_FP8_CVT_ENV}={value!r}: expected 'f16' or 'query'")
    return value == "f16"


@functools.cache
def _has_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch needs sm_90 or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


@attrs.frozen(kw_only=True)
class MLALaunch:
    """How one `TritonMLAImpl.forward` launches (from `TritonMLAImpl.plan_launch`).

    Attributes
    ----------
    num_tokens:
        Real tokens (the grid's first dimension).
    head_blocks:
        Programs per token along the heads (``cdiv(H, heads_per_program)``).
    heads_per_program:
        Query heads each program serves (``block_h``, or the config's `narrow_heads` on a
        launch it narrows).
    splits, split_len:
        Split-KV segments per token and positions per segment (a multiple of ``block_n``).
    lat_pad:
        Latent width padded to a power of two (the partials' last dimension).
    pdl:
        Whether the kernels are launched with programmatic dependent launch.
    part_acc, part_ml:
        ``[T, H, splits, lat_pad]`` and ``[T, H, splits, 2]`` float32 partials (None when
        unsplit; ``part_acc`` in the query's 16-bit dtype with
        `MLAKernelConfig.half_partials`); with a fused merge ``[T, head_blocks, 2 * splits,
        block_h, lat_pad]`` and ``[T, head_blocks, 2 * splits, block_h, 2]`` (the tree's
        levels).
    counters:
        With a fused merge (`MLAKernelConfig.fused_fanin`) on a split launch: the impl's
        persistent int32 group counters (zero between launches), else None.
    """

    num_tokens: int
    head_blocks: int
    splits: int
    split_len: int
    lat_pad: int
    pdl: bool
    part_acc: torch.Tensor | None
    part_ml: torch.Tensor | None
    counters: torch.Tensor | None = None
    heads_per_program: int = 16


@attrs.frozen(kw_only=True)
class TritonMLAMetadata:
    """The Triton MLA plan for one step.

    Attributes
    ----------
    token_req:
        ``[T_actual]`` int32 on the device: the request of each real token.
    token_kv_len:
        ``[T_actual]`` int32 on the device: positions each token sees (causal end).
    block_table:
        ``[B, max_blocks]`` int32 on the device.
    num_actual_tokens:
        Real tokens; rows past it are padding and are left zero.
    max_seq_len:
        Longest request of the step (the impl picks the split-KV count from it).
    """

    token_req: torch.Tensor
    token_kv_len: torch.Tensor
    block_table: torch.Tensor
    num_actual_tokens: int
    max_seq_len: int


class TritonMLAMetadataBuilder(MetadataBuilder[TritonMLAMetadata]):
    """Per-token request ids and visible lengths (causal end) on the device."""

    reorder_batch_threshold: ClassVar[int] = 1

    def build(
        self, common: CommonAttentionMetadata, *, common_prefix_len: int = 0
    ) -> TritonMLAMetadata:
        qsl = common.query_start_loc_cpu.long()
        q_lens = qsl[1:] - qsl[:-1]
        num_tokens = int(common.num_actual_tokens)
        token_req = torch.repeat_interleave(torch.arange(common.num_reqs), q_lens)
        index_in_req = torch.arange(num_tokens) - qsl[token_req]
        seq_lens = common.seq_lens_cpu.long()
        kv_len = seq_lens[token_req] - q_lens[token_req] + index_in_req + 1
        device = common.block_table.device
        return TritonMLAMetadata(
            token_req=token_req.to(device=device, dtype=torch.int32),
            token_kv_len=kv_len.to(device=device, dtype=torch.int32),
            block_table=common.block_table,
            num_actual_tokens=num_tokens,
            max_seq_len=int(common.max_seq_len),
        )


class TritonMLAImpl(MLAImplBase[TritonMLAMetadata]):
    """Triton MLA over the paged latent cache (contract: `pagedcore.reference.mla`); the
    parameters are `pagedcore.reference.mla.MLAImplBase`'s (``kv_lora_rank`` required)."""

    unsupported_features: ClassVar[str] = (
        "triton_mla supports neither ALiBi, sliding window nor soft-cap"
    )

    #: Query heads per program (each loaded cache row serves all of them).
    block_h: ClassVar[int] = 16
    #: Tile, launch options and split-KV rule of the decode kernel (per instance, so a bench
    #: can try others; see `MLA_KERNEL_CONFIGS`).
    kernel_config: MLAKernelConfig = DEFAULT_MLA_KERNEL
    #: From this many (token, head) pairs on, one merge program combines a whole latent row.
    merge_whole_row_pairs: ClassVar[int] = MERGE_WHOLE_ROW_PAIRS
    #: The compiled kernels of the last `forward` (decode, then merge when split), for the
    #: bench's register / shared-memory report.
    last_kernels: tuple[Any, ...] = ()
    #: The fused merge's group counters (`_counters`), per instance once allocated.
    _fused_counters: torch.Tensor | None = None

    def do_kv_cache_update(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write ``key`` ``[T, 1, L + R]`` into ``kv_cache`` ``[N, B, L + R]`` with one Triton
        program per token; slots of ``-1`` are skipped on the device (no host sync).

        ``value`` is ignored. Only the first ``len(slot_mapping)`` tokens are written. An fp8
        cache (``kv_cache_dtype`` fp8) stores ``fp8(row / k_scale)``, quantized in the kernel
        (under Triton's interpreter, whose fp32 -> fp8 conversion rounds wrongly, by torch
        first; the kernel then scatters the bytes).
        """
        from pagedcore_triton.mla_kernels import mla_cache_write_kernel

        check_mla_write_args(key, kv_cache, slot_mapping)
        check_mla_cache_dtype(self, kv_cache)
        num_tokens = slot_mapping.shape[0]
        if num_tokens == 0:
            return
        if key.stride(-1) != 1 or kv_cache.stride(-1) != 1:
            raise ValueError("triton_mla needs the key and cache contiguous in the last dim")
        dim = kv_cache.shape[-1]
        k_scale: torch.Tensor = slot_mapping  # unused without fp8
        quant_max = None
        if self.kv_fp8:
            k_scale = self.kv_scales_on(kv_cache.device)[0]
            if interpreting():
                from pagedcore.attention.kv_quant import quantize_fp8

                key = quantize_fp8(key, k_scale, kv_cache.dtype).view(torch.uint8)
                kv_cache = kv_cache.view(torch.uint8)
            else:
                quant_max = float(torch.finfo(kv_cache.dtype).max)
        mla_cache_write_kernel[(num_tokens,)](
            key, kv_cache, slot_mapping, k_scale, key.stride(0), kv_cache.stride(0),
            kv_cache.stride(1), DIM=dim, DIM_PAD=_next_pow2(dim), BLOCK_SIZE=kv_cache.shape[1],
            QUANT_MAX=quant_max,
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TritonMLAMetadata,
        *,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Latent attention for the batch.

        Parameters
        ----------
        query:
            ``[T, H, L + R]`` (absorbed ``q_nope`` then roped ``q_pe``), model dtype.
        key, value:
            Ignored (read from the cache).
        kv_cache:
            ``[num_blocks, block_size, L + R]``, contiguous in its last two dims.
        metadata:
            From `TritonMLAMetadataBuilder.build`.
        output:
            Optional ``[T, H, L]`` buffer.

        Returns
        -------
        torch.Tensor
            ``[T, H, L]``; padding rows are zero.
        """
        num_tokens, num_heads, dim = query.shape
        lat = self.kv_lora_rank
        check_mla_cache_dtype(self, kv_cache)
        if dim != kv_cache.shape[-1] or num_heads != self.num_heads:
            raise ValueError(
                f"query {tuple(query.shape)} does not match num_heads={self.num_heads} and the "
                f"cache row size {kv_cache.shape[-1]}"
            )
        if kv_cache.stride(-1) != 1 or query.stride(-1) != 1:
            raise ValueError("triton_mla needs the cache and query contiguous in the last dim")
        out = output if output is not None else query.new_empty(num_tokens, num_heads, lat)
        actual = metadata.num_actual_tokens
        if actual < num_tokens:
            out[actual:].zero_()
        if actual == 0:
            return out
        launch = self.plan_launch(query, metadata)
        self.launch_decode(launch, query, kv_cache, metadata, out)
        if launch.splits > 1 and launch.counters is None:
            self.launch_merge(launch, out)
        return out

    def _counters(self, device: torch.device, size: int) -> torch.Tensor:
        """The persistent zeroed int32 counters of the fused merge (each launch leaves them
        zero), grown to at least `size`. One impl serves one stream at a time."""
        have = self._fused_counters
        if have is None or have.device != device or have.numel() < size:
            have = torch.zeros(max(size, 4096), dtype=torch.int32, device=device)
            self._fused_counters = have
        return have

    def plan_launch(self, query: torch.Tensor, metadata: TritonMLAMetadata) -> MLALaunch:
        """Split count, segment length and partial buffers of one `forward` (no launch).

        ``query`` is ``[T, H, L + R]``; the partials are ``[T_actual, H, splits, L_pad]`` and
        ``[T_actual, H, splits, 2]`` float32 when the context is split (the first in the
        query's dtype with ``half_partials`` and a 16-bit query).
        """
        cfg = self.kernel_config
        actual = metadata.num_actual_tokens
        lat_pad = max(16, _next_pow2(self.kv_lora_rank))
        per_prog = self.block_h
        head_blocks = -(-self.num_heads // per_prog)
        splits = choose_mla_splits(cfg.split, num_tokens=actual, head_blocks=head_blocks,
                                   max_seq_len=metadata.max_seq_len)
        narrow = cfg.narrow_heads
        if narrow is not None and narrow < per_prog and splits >= cfg.narrow_min_splits:
            per_prog = narrow
            head_blocks = -(-self.num_heads // per_prog)
            splits = choose_mla_splits(cfg.split, num_tokens=actual, head_blocks=head_blocks,
                                       max_seq_len=metadata.max_seq_len)
        # Segments start on tile boundaries (whole blocks when BLOCK_N is a multiple of them).
        seg = -(-metadata.max_seq_len // splits)
        split_len = -(-seg // cfg.block_n) * cfg.block_n
        part_acc = part_ml = counters = None
        if splits > 1 and cfg.fused_fanin is not None:
            slots = (actual, head_blocks, 2 * splits, self.block_h)
            part_acc = torch.empty(*slots, lat_pad, dtype=torch.float32, device=query.device)
            part_ml = torch.empty(*slots, 2, dtype=torch.float32, device=query.device)
            counters = self._counters(query.device, actual * head_blocks * splits)
        elif splits > 1:
            half = cfg.half_partials and query.dtype in (torch.bfloat16, torch.float16)
            part_acc = torch.empty(actual, self.num_heads, splits, lat_pad,
                                   dtype=query.dtype if half else torch.float32,
                                   device=query.device)
            part_ml = torch.empty(actual, self.num_heads, splits, 2, dtype=torch.float32,
                                  device=query.device)
        pdl = cfg.pdl and not interpreting() and _has_pdl(query.device)
        return MLALaunch(num_tokens=actual, head_blocks=head_blocks, splits=splits,
                         split_len=split_len, lat_pad=lat_pad, pdl=pdl, part_acc=part_acc,
                         part_ml=part_ml, counters=counters, heads_per_program=per_prog)

    def launch_decode(
        self,
        launch: MLALaunch,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TritonMLAMetadata,
        out: torch.Tensor,
        *,
        probe: torch.Tensor | None = None,
    ) -> None:
        """The decode kernel: ``out`` ``[T, H, L]`` directly when unsplit, else the partials.

        ``probe`` (a diagnostic, CUDA only): an int64 ``[programs, 8]`` tensor that each
        program fills with its SM and ``%globaltimer`` times (see ``mla_decode_kernel``);
        that launch compiles a separate, instrumented kernel.
        """
        from pagedcore_triton.mla_kernels import mla_decode_kernel

        cfg = self.kernel_config
        lat = self.kv_lora_rank
        rope = query.shape[-1] - lat
        interp = interpreting()
        programs = launch.num_tokens * launch.head_blocks * launch.splits
        if probe is not None and (interp or probe.dtype != torch.int64
                                  or probe.numel() < 8 * programs):
            raise ValueError(f"probe must be an int64 CUDA tensor of at least [{programs}, 8] "
                             "(programs, fields); it cannot run in the interpreter")
        options: dict[str, Any] = {
            "num_warps": cfg.launch_warps(launch.splits, launch.split_len),
            "num_stages": cfg.num_stages,
        }
        if cfg.maxnreg is not None and not interp:
            options["maxnreg"] = cfg.maxnreg
        if launch.pdl:
            options["launch_pdl"] = True
        part_acc = launch.part_acc if launch.part_acc is not None else out  # unused if None
        part_ml = launch.part_ml if launch.part_ml is not None else out
        grid = (launch.num_tokens, launch.head_blocks, launch.splits)
        if cfg.split_first and launch.splits > 1:  # few tokens (<= the split target)
            grid = grid[::-1]
            options["SPLIT_FIRST"] = True
        counters = launch.counters if launch.counters is not None else out  # unused if None
        if probe is not None:
            options["PROBE"] = True
        if cfg.rowsum_2d:
            options["ROWSUM_2D"] = True
        if launch.heads_per_program != self.block_h:
            options["HEADS_PER_PROG"] = launch.heads_per_program
        k_scale = metadata.token_req  # unused without fp8
        if self.kv_fp8:
            options["KV_FP8"] = True
            k_scale = self.kv_scales_on(kv_cache.device)[0]
            if not interp and query.dtype != torch.float32 and fp8_converts_to_f16():
                options["Q_F16"] = True
        compiled = mla_decode_kernel[grid](
            out, part_acc, part_ml, counters, probe if probe is not None else counters,
            query, kv_cache, metadata.block_table,
            metadata.token_req, metadata.token_kv_len, k_scale,
            self.num_heads, launch.splits, self.scale * 1.4426950408889634, launch.split_len,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            kv_cache.stride(0), kv_cache.stride(1), metadata.block_table.stride(0),
            LATENT=lat, LATENT_PAD=launch.lat_pad,
            LAT_SPLIT=min(cfg.lat_split, launch.lat_pad // 16), ROPE=rope,
            ROPE_PAD=max(16, _next_pow2(rope)), BLOCK_SIZE=kv_cache.shape[1],
            BLOCK_H=self.block_h, BLOCK_N=cfg.block_n, WRITE_PARTIAL=launch.splits > 1,
            DOT_FP32=interp or query.dtype == torch.float32, USE_PDL=launch.pdl,
            FANIN=(cfg.fused_fanin or 0) if launch.counters is not None else 0, **options,
        )
        self.last_kernels = (compiled,)

    def launch_merge(self, launch: MLALaunch, out: torch.Tensor) -> None:
        """The merge kernel: combine `launch`'s partials into ``out`` ``[T, H, L]``."""
        from pagedcore_triton.mla_merge import mla_merge_kernel

        if launch.part_acc is None or launch.part_ml is None:
            raise ValueError("launch_merge needs a split launch (plan_launch gave 1 split)")
        if launch.counters is not None:
            raise ValueError("launch_merge: this launch merges inside the decode kernel "
                             "(kernel_config.fused_fanin); there is nothing left to merge")
        lat_pad = launch.lat_pad
        cols, chunk, warps = merge_layout(
            self.kernel_config, num_tokens=launch.num_tokens, num_heads=self.num_heads,
            lat_pad=lat_pad, splits=launch.splits, whole_row_pairs=self.merge_whole_row_pairs)
        options: dict[str, Any] = {"num_warps": warps}
        if launch.pdl:
            options["launch_pdl"] = True
        merged = mla_merge_kernel[(launch.num_tokens, self.num_heads, lat_pad // cols)](
            out, launch.part_acc, launch.part_ml, self.num_heads, launch.splits,
            out.stride(0), out.stride(1), LATENT=self.kv_lora_rank, LATENT_PAD=lat_pad,
            COLS=cols, CHUNK=chunk, USE_PDL=launch.pdl, **options,
        )
        self.last_kernels = (*self.last_kernels[:1], merged)


class TritonMLABackend(MLAAttentionBackend):
    """Triton MLA: paged latent cache, one kernel for mixed batches, split-KV decode."""

    name: ClassVar[str] = "triton_mla"
    priority: ClassVar[int] = 20
    priority_reason: ClassVar[str | None] = (
        "1.8-1.9x flashinfer_mla's decode on the H200 (74-86 % of copy bandwidth against "
        "40-47 %, bf16 512+64, 16 heads: docs/benchmarks/h200_s11/mla_backends_h200.json)"
    )
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float16", "bfloat16", "float32")
    supported_devices: ClassVar[tuple[str, ...]] = (
        ("cuda", "cpu") if interpreting() else ("cuda",)
    )
    #: fp8 latent caches: rows quantized at the cache write, read as fp8 and converted in
    #: registers (``KV_FP8`` of the decode kernel), one ``k_scale`` per layer.
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto", "fp8_e4m3", "fp8_e5m2")

    @classmethod
    def is_available(cls) -> str | None:
        return triton_unavailable_reason()

    @classmethod
    def get_builder_cls(cls) -> type[MetadataBuilder[Any]]:
        return TritonMLAMetadataBuilder

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl[Any]]:
        return TritonMLAImpl
