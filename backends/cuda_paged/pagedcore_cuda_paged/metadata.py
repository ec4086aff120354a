"""The cuda_paged plan for one step: decode requests, prefill tiles, decode pass inputs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from pagedcore.attention.backend import MetadataBuilder
from pagedcore_cuda_paged.handoff import handoff_reason, handoff_runs, launch_parts
from pagedcore_cuda_paged.plan import (
    DEFAULT_PREFILL_KERNEL,
    DecodePolicy,
    PrefillKernel,
    prefill_kernel_code,
    prefill_tiles,
)

if TYPE_CHECKING:
    import torch

    from pagedcore.attention.metadata import CommonAttentionMetadata
    from pagedcore.kv_cache.spec import AttentionSpec

__all__ = ["CudaPagedMetadata", "CudaPagedMetadataBuilder"]


@attrs.frozen(kw_only=True)
class CudaPagedMetadata:
    """What the cuda_paged kernels read in one step (shared by every layer of the group).

    Attributes
    ----------
    query_start_loc, seq_lens, block_table, slot_mapping:
        The step's common tensors, on the device (int32, except slot_mapping int64).
    decode_reqs:
        ``[num_decodes]`` int32: requests with exactly one new token (the decode kernel).
    decode_seq_lens:
        Their ``seq_lens`` on the CPU, for choosing the decode pass.
    prefill_tiles:
        ``[num_tiles, 2]`` int32 ``(request, first query row)`` for requests with more than
        one new token (the prefill kernel, `prefill_rows` rows a tile).
    block_size:
        Tokens per KV-cache block.
    policy:
        When decode runs partitioned.
    prefill_kernel:
        Which prefill kernel was asked for (`PrefillKernel`).
    prefill_variant, prefill_rows:
        What runs: the extension's variant (0 mma, 1 wmma, 2 wmma lane per key; MMA falls
        back to WMMA for float32 and head size 256) and query rows per tile.
    causal:
        Decoder self-attention (the query aligned to the end of its sequence).
    decode_max_seq_len:
        Set by `CudaPagedMetadataBuilder.build_for_cudagraph_capture`: the decode launch is
        planned for any lengths up to this (``decode_seq_lens`` are then placeholders).
    handoff_parts:
        Prompts with no cached context handed to triton's Hopper prefill kernel
        (`pagedcore_cuda_paged.handoff`): one ``pagedcore_triton.plan.LaunchPart`` per
        contiguous run of them; their tiles are not in `prefill_tiles`.
    handoff_tiles:
        ``[n, 2]`` int32: the handed-off requests' own prefill tiles, which a layer the
        Hopper kernel does not serve runs instead (None without a handoff).
    launches:
        Hopper-kernel launches prepared by the first layer, reused by the others.
    """

    num_actual_tokens: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    decode_reqs: torch.Tensor
    decode_seq_lens: list[int]
    prefill_tiles: torch.Tensor
    block_size: int
    policy: DecodePolicy
    prefill_kernel: PrefillKernel = DEFAULT_PREFILL_KERNEL
    prefill_variant: int = 0
    prefill_rows: int = 128
    causal: bool = True
    decode_max_seq_len: int | None = None
    handoff_parts: tuple[Any, ...] = ()
    handoff_tiles: torch.Tensor | None = None
    launches: dict[tuple[Any, ...], Any] = attrs.field(factory=dict, eq=False, repr=False)

    @property
    def num_decodes(self) -> int:
        return len(self.decode_seq_lens)

    @property
    def num_prefill_tiles(self) -> int:
        return int(self.prefill_tiles.shape[0])


class CudaPagedMetadataBuilder(MetadataBuilder[CudaPagedMetadata]):
    """Splits the step into decodes and prefill tiles; works in any batch order.

    Parameters
    ----------
    kv_cache_spec, layer_names, device:
        As for every `MetadataBuilder`.
    policy:
        Decode kernel and pass policy (defaults measured on the H200).
    prefill_kernel:
        See `CudaPagedMetadata.prefill_kernel`.

    Attributes
    ----------
    handoff_why_not:
        None when prompts with no cached context go to triton's Hopper prefill kernel
        (`pagedcore_cuda_paged.handoff`), else why they stay on cuda_paged's prefill.
    """

    reorder_batch_threshold: ClassVar[int] = 1

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: Sequence[str],
        device: torch.device,
        *,
        policy: DecodePolicy | None = None,
        prefill_kernel: PrefillKernel = DEFAULT_PREFILL_KERNEL,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, device)
        self.policy = DecodePolicy() if policy is None else policy
        self.prefill_kernel = prefill_kernel
        self.handoff_why_not = handoff_reason(kv_cache_spec, device)

    def build(
        self, common: CommonAttentionMetadata, *, common_prefix_len: int = 0
    ) -> CudaPagedMetadata:
        import torch

        query_lens = common.query_lens_cpu.tolist()
        seq_lens = common.seq_lens_cpu.tolist()
        decodes = [i for i, q in enumerate(query_lens) if q == 1]
        spec = self.kv_cache_spec
        variant, rows = prefill_kernel_code(self.prefill_kernel, head_size=spec.head_size,
                                            is_float32=spec.dtype == "float32")
        tiles = prefill_tiles(query_lens, rows)
        device = common.query_start_loc.device
        parts: tuple[Any, ...] = ()
        handed: list[tuple[int, int]] = []
        runs = handoff_runs(query_lens, seq_lens) if self.handoff_why_not is None else []
        if runs:
            fresh = {i for a, b in runs for i in range(a, b)}
            handed = [t for t in tiles if t[0] in fresh]
            tiles = [t for t in tiles if t[0] not in fresh]
            parts = launch_parts(runs, common.query_start_loc_cpu.tolist(), query_lens)

        def int32(rows: list[int] | list[tuple[int, int]], shape: tuple[int, ...]) -> torch.Tensor:
            cpu = torch.tensor(rows, dtype=torch.int32).reshape(shape)
            return cpu.to(device, non_blocking=True)

        return CudaPagedMetadata(
            num_actual_tokens=common.num_actual_tokens,
            query_start_loc=common.query_start_loc,
            seq_lens=common.seq_lens,
            block_table=common.block_table,
            slot_mapping=common.slot_mapping,
            decode_reqs=int32(decodes, (len(decodes),)),
            decode_seq_lens=[seq_lens[i] for i in decodes],
            prefill_tiles=int32(tiles, (len(tiles), 2)),
            block_size=self.kv_cache_spec.block_size,
            policy=self.policy,
            prefill_kernel=self.prefill_kernel,
            prefill_variant=variant,
            prefill_rows=rows,
            causal=common.causal,
            handoff_parts=parts,
            handoff_tiles=int32(handed, (len(handed), 2)) if parts else None,
        )

    def build_for_cudagraph_capture(self, common: CommonAttentionMetadata) -> CudaPagedMetadata:
        """Plan a uniform single-token decode batch for capture and every replay.

        Nothing depends on this step's lengths: the decode launch (kernel, pass, partition
        count) is planned for ``common.max_seq_len`` (`decode_max_seq_len`), the kernels read
        the actual ``seq_lens`` on the device and skip partitions past them, and every
        request is a decode (``decode_reqs`` = 0..num_reqs-1, fixed).
        """
        query_lens = common.query_lens_cpu.tolist()
        if any(q != 1 for q in query_lens):
            raise ValueError(
                "build_for_cudagraph_capture takes uniform single-token decode batches only "
                f"(query lengths {sorted(set(query_lens))})"
            )
        meta = self.build(common)
        return attrs.evolve(
            meta,
            decode_seq_lens=[common.max_seq_len] * len(query_lens),
            decode_max_seq_len=common.max_seq_len,
        )
