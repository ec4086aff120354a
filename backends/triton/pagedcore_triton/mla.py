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
from pagedcore.reference.mla import MLAImplBase, check_mla_write_args
from pagedcore_triton._env import interpreting, triton_unavailable_reason

__all__ = [
    "DEFAULT_MLA_KERNEL",
    "MLA_KERNEL_CONFIGS",
    "MLAKernelConfig",
    "MLASplitRule",
    "TritonMLABackend",
    "TritonMLAImpl",
    "TritonMLAMetadata",
    "TritonMLAMetadataBuilder",
    "choose_mla_splits",
]


def _next_pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


@functools.cache
def _has_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch needs sm_90 or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


@attrs.frozen(kw_only=True)
class MLASplitRule:
    """Split-KV rule: double the splits while the grid stays within `target_programs` programs
    (about one wave of resident programs on an H200's 132 SMs), each split keeps at least
    `min_tokens_per_split` positions, and the count stays at most `max_splits` (a power of
    two)."""

    target_programs: int = 264
    min_tokens_per_split: int = 128
    max_splits: int = 64


def choose_mla_splits(
    rule: MLASplitRule, *, num_tokens: int, head_blocks: int, max_seq_len: int
) -> int:
    """Power-of-two split count for one launch (1 = no split)."""
    programs = max(1, num_tokens * head_blocks)
    splits = 1
    while (
        splits * 2 <= rule.max_splits
        and programs * splits * 2 <= rule.target_programs
        and max_seq_len // (splits * 2) >= rule.min_tokens_per_split
    ):
        splits *= 2
    return splits


@attrs.frozen(kw_only=True)
class MLAKernelConfig:
    """One launch configuration of the decode kernel (the variants the bench times).

    Attributes
    ----------
    name:
        Short label used by the bench and in ``MLA_KERNEL_CONFIGS``.
    block_n:
        Cache positions per inner tile (``BLOCK_N``).
    num_warps, num_stages:
        Triton launch options. ``num_stages`` 2-4 leave the row tile single-buffered (the
        block-table load takes a pipeline stage), 5-6 double-buffer it, 7-8 triple-buffer it.
    maxnreg:
        Register cap per thread (None = the compiler's choice); lower caps fit more programs
        per SM. Ignored under the interpreter.
    lat_split:
        Latent column chunks (1, 2 or 4; fewer when the latent is narrow): each chunk has its
        own score MMA chain and accumulator, so the MMAs of a tile do not form one chain.
    split:
        When to split the context into segments (split-KV).
    rows_m:
        Use `mla_rows_kernel` (cache positions as the MMA's M side, so that with ``block_n``
        64 Triton can use Hopper's warpgroup MMA) instead of `mla_kernels.mla_decode_kernel`.
    pdl:
        Launch the kernels with programmatic dependent launch (sm_90 and newer; ignored on
        older GPUs and under the interpreter): each kernel's programs are placed while the
        previous kernel drains and wait for its results (``griddepcontrol.wait``) before
        reading anything, which hides the launch gaps between the decode and merge kernels
        and between steps.
    merge_chunk:
        Most split partials the merge kernel reads per round trip (a power of two; fewer
        when the split count or the register budget is smaller).
    short_split_warps, short_split_len:
        When set, the warps of a split launch whose segments have at most `short_split_len`
        positions (few tiles per program, e.g. 4 requests of 32768 tokens in 64 splits).
    """

    name: str
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 2
    maxnreg: int | None = None
    lat_split: int = 1
    split: MLASplitRule = MLASplitRule()
    rows_m: bool = False
    pdl: bool = False
    merge_chunk: int = 16
    short_split_warps: int | None = None
    short_split_len: int = 512

    def launch_warps(self, splits: int, split_len: int) -> int:
        """``num_warps``, or `short_split_warps` for a split launch of short segments."""
        if self.short_split_warps is not None and splits > 1 and (
            split_len <= self.short_split_len
        ):
            return self.short_split_warps
        return self.num_warps

    def __attrs_post_init__(self) -> None:
        if self.lat_split not in (1, 2, 4):
            raise ValueError(f"lat_split must be 1, 2 or 4, got {self.lat_split}")
        if self.merge_chunk < 2 or self.merge_chunk & (self.merge_chunk - 1):
            raise ValueError(f"merge_chunk must be a power of two >= 2, got {self.merge_chunk}")
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n must be a power of two >= 16, got {self.block_n}")


#: The decode variants `pagedcore bench mla --variants` times; ``DEFAULT_MLA_KERNEL`` is the
#: shipped one (the best measured on the H200, see docs/mla.md). Names: ``n<BLOCK_N>`` (or
#: ``m<BLOCK_N>`` with ``rows_m``), ``s<stages>``, ``c<lat_split>``, ``w<warps>`` (when not
#: 4), ``p`` (``pdl``), ``m<merge_chunk>`` (when not 16), ``w2s`` (``short_split_warps``
#: 2), ``r<maxnreg>``, ``t<split target>`` (when not 264).
MLA_KERNEL_CONFIGS: dict[str, MLAKernelConfig] = {
    c.name: c
    for c in (
        # The shipped one: PDL, and up to 64 splits merged in one round trip.
        MLAKernelConfig(name="n32s5c4pm64", block_n=32, num_stages=5, lat_split=4, pdl=True,
                        merge_chunk=64),
        MLAKernelConfig(name="n32s5c4p", block_n=32, num_stages=5, lat_split=4, pdl=True),
        # The previous default (no PDL, 16 splits per merge round trip):
        MLAKernelConfig(name="n32s5c4", block_n=32, num_stages=5, lat_split=4),
        # 2 warps (255 registers; still 2 programs per SM, bound by 94 KB of shared memory):
        # +4 points at 4 x 32768, 1-5 points slower elsewhere (with merge_chunk 16).
        MLAKernelConfig(name="n32s5c4w2pm64", block_n=32, num_warps=2, num_stages=5,
                        lat_split=4, pdl=True, merge_chunk=64),
        # The default, with 2 warps where the segments are short (the one shape where 2 warps
        # measured faster: 4 x 32768 in 64 splits of 512):
        MLAKernelConfig(name="n32s5c4pm64w2s", block_n=32, num_stages=5, lat_split=4, pdl=True,
                        merge_chunk=64, short_split_warps=2),
        # Positions as the MMA's M side (Hopper warpgroup MMA), 64-row tiles, 1 program/SM:
        MLAKernelConfig(name="m64s4c4p", block_n=64, num_stages=4, lat_split=4, pdl=True,
                        rows_m=True, split=MLASplitRule(target_programs=132)),
        # One score-MMA chain over all 576 dims, single-buffered rows (the first kernel):
        MLAKernelConfig(name="n32s2", block_n=32, num_stages=2,
                        split=MLASplitRule(target_programs=528)),
    )
}
DEFAULT_MLA_KERNEL = MLA_KERNEL_CONFIGS["n32s5c4pm64"]


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
    merge_whole_row_pairs: ClassVar[int] = 1024
    #: The compiled kernels of the last `forward` (decode, then merge when split), for the
    #: bench's register / shared-memory report.
    last_kernels: tuple[Any, ...] = ()

    def do_kv_cache_update(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write ``key`` ``[T, 1, L + R]`` into ``kv_cache`` ``[N, B, L + R]`` with one Triton
        program per token; slots of ``-1`` are skipped on the device (no host sync).

        ``value`` is ignored. Only the first ``len(slot_mapping)`` tokens are written.
        """
        from pagedcore_triton.mla_kernels import mla_cache_write_kernel

        check_mla_write_args(key, kv_cache, slot_mapping)
        num_tokens = slot_mapping.shape[0]
        if num_tokens == 0:
            return
        if key.stride(-1) != 1 or kv_cache.stride(-1) != 1:
            raise ValueError("triton_mla needs the key and cache contiguous in the last dim")
        dim = kv_cache.shape[-1]
        mla_cache_write_kernel[(num_tokens,)](
            key, kv_cache, slot_mapping, key.stride(0), kv_cache.stride(0), kv_cache.stride(1),
            DIM=dim, DIM_PAD=_next_pow2(dim), BLOCK_SIZE=kv_cache.shape[1],
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
        from pagedcore_triton.mla_kernels import mla_decode_kernel, mla_merge_kernel
        from pagedcore_triton.mla_rows_kernel import mla_decode_rows_kernel

        num_tokens, num_heads, dim = query.shape
        lat = self.kv_lora_rank
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
        cfg = self.kernel_config
        lat_pad = max(16, _next_pow2(lat))
        rope = dim - lat
        lat_split = min(cfg.lat_split, lat_pad // 16)
        block_size = kv_cache.shape[1]
        block_h = self.block_h
        head_blocks = -(-num_heads // block_h)
        splits = choose_mla_splits(cfg.split, num_tokens=actual, head_blocks=head_blocks,
                                   max_seq_len=metadata.max_seq_len)
        # Segments start on tile boundaries (whole blocks when BLOCK_N is a multiple of them).
        seg = -(-metadata.max_seq_len // splits)
        split_len = -(-seg // cfg.block_n) * cfg.block_n
        interp = interpreting()
        dot_fp32 = interp or query.dtype == torch.float32
        if splits > 1:
            part_acc = torch.empty(actual, num_heads, splits, lat_pad, dtype=torch.float32,
                                   device=query.device)
            part_ml = torch.empty(actual, num_heads, splits, 2, dtype=torch.float32,
                                  device=query.device)
        else:
            part_acc = part_ml = out  # unused
        options: dict[str, Any] = {"num_warps": cfg.launch_warps(splits, split_len),
                                   "num_stages": cfg.num_stages}
        if cfg.maxnreg is not None and not interp:
            options["maxnreg"] = cfg.maxnreg
        pdl = cfg.pdl and not interp and _has_pdl(query.device)
        launch: dict[str, Any] = {"launch_pdl": True} if pdl else {}
        decode = mla_decode_rows_kernel if cfg.rows_m else mla_decode_kernel
        compiled = decode[(actual, head_blocks, splits)](
            out, part_acc, part_ml, query, kv_cache, metadata.block_table,
            metadata.token_req, metadata.token_kv_len,
            num_heads, splits, self.scale * 1.4426950408889634, split_len,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            kv_cache.stride(0), kv_cache.stride(1), metadata.block_table.stride(0),
            LATENT=lat, LATENT_PAD=lat_pad, LAT_SPLIT=lat_split, ROPE=rope,
            ROPE_PAD=max(16, _next_pow2(rope)), BLOCK_SIZE=block_size, BLOCK_H=block_h,
            BLOCK_N=cfg.block_n, WRITE_PARTIAL=splits > 1,
            DOT_FP32=dot_fp32, USE_PDL=pdl, **options, **launch,
        )
        self.last_kernels = (compiled,)
        if splits > 1:
            # About one wave of merge programs: whole rows when there are many (token, head)
            # pairs, 128-column slices when there are few (few long requests). Each reads up
            # to `chunk` splits per round trip ([chunk, cols] fp32 in registers).
            many = actual * num_heads >= self.merge_whole_row_pairs
            cols = lat_pad if many else min(128, lat_pad)
            chunk = max(2, min(cfg.merge_chunk, _next_pow2(splits), 8192 // cols))
            merged = mla_merge_kernel[(actual, num_heads, lat_pad // cols)](
                out, part_acc, part_ml, num_heads, splits, out.stride(0), out.stride(1),
                LATENT=lat, LATENT_PAD=lat_pad, COLS=cols, CHUNK=chunk, USE_PDL=pdl, **launch,
            )
            self.last_kernels = (compiled, merged)
        return out


class TritonMLABackend(MLAAttentionBackend):
    """Triton MLA: paged latent cache, one kernel for mixed batches, split-KV decode."""

    name: ClassVar[str] = "triton_mla"
    priority: ClassVar[int] = 20
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float16", "bfloat16", "float32")
    supported_devices: ClassVar[tuple[str, ...]] = (
        ("cuda", "cpu") if interpreting() else ("cuda",)
    )

    @classmethod
    def is_available(cls) -> str | None:
        return triton_unavailable_reason()

    @classmethod
    def get_builder_cls(cls) -> type[MetadataBuilder[Any]]:
        return TritonMLAMetadataBuilder

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl[Any]]:
        return TritonMLAImpl
