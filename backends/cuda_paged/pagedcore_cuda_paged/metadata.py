"""The cuda_paged plan for one step: decode requests, prefill tiles, decode pass inputs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import attrs

from pagedcore.attention.backend import MetadataBuilder
from pagedcore_cuda_paged.plan import DecodePolicy, prefill_tiles

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
        one new token (the prefill kernel, 64 rows a tile).
    block_size:
        Tokens per KV-cache block.
    policy:
        When decode runs partitioned.
    prefill_lane_per_key:
        Run the prefill softmax in its first formulation (one lane per key, rows in turn), a
        slower reference path kept for comparison; the default has two lanes per row.
    causal:
        Decoder self-attention (the query aligned to the end of its sequence).
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
    prefill_lane_per_key: bool = False
    causal: bool = True

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
        Decode pass policy (defaults measured on the H200).
    prefill_lane_per_key:
        See `CudaPagedMetadata.prefill_lane_per_key`.
    """

    reorder_batch_threshold: ClassVar[int] = 1

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: Sequence[str],
        device: torch.device,
        *,
        policy: DecodePolicy | None = None,
        prefill_lane_per_key: bool = False,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, device)
        self.policy = DecodePolicy() if policy is None else policy
        self.prefill_lane_per_key = prefill_lane_per_key

    def build(
        self, common: CommonAttentionMetadata, *, common_prefix_len: int = 0
    ) -> CudaPagedMetadata:
        import torch

        query_lens = common.query_lens_cpu.tolist()
        seq_lens = common.seq_lens_cpu.tolist()
        decodes = [i for i, q in enumerate(query_lens) if q == 1]
        tiles = prefill_tiles(query_lens)
        device = common.query_start_loc.device

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
            prefill_lane_per_key=self.prefill_lane_per_key,
            causal=common.causal,
        )
