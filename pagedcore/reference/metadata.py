"""The reference backend's plan: requests grouped by query length, with their KV slots."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import attrs
import torch

from pagedcore.attention.backend import MetadataBuilder
from pagedcore.attention.cascade import check_common_prefix_len
from pagedcore.attention.metadata import CommonAttentionMetadata

if TYPE_CHECKING:
    from pagedcore.kv_cache.spec import AttentionSpec

__all__ = ["ReferenceMetadata", "ReferenceMetadataBuilder", "RequestGroup"]

#: Upper bound on ``requests * query_len * key_len`` of one group, so that batching many
#: equal-length requests never builds a huge score tensor (a lone request may exceed it).
MAX_GROUP_SCORES = 1 << 21


@attrs.frozen(kw_only=True)
class RequestGroup:
    """Requests with the same query length ``Lq``, attended together.

    Attributes
    ----------
    token_rows:
        ``[N * Lq]`` int64 on the device: rows of the flattened batch, request-major.
    slots:
        ``[N, Lk]`` int64 on the device: flat KV slot of each key position (``Lk`` = the
        longest ``seq_len`` of the group); positions past a request's ``seq_len`` hold 0.
    seq_lens:
        ``[N]`` int64 on the device.
    num_reqs, query_len:
        ``N`` and ``Lq``.
    """

    token_rows: torch.Tensor
    slots: torch.Tensor
    seq_lens: torch.Tensor
    num_reqs: int
    query_len: int


@attrs.frozen(kw_only=True)
class ReferenceMetadata:
    """What `ReferenceImpl.forward` needs for one step.

    Attributes
    ----------
    common:
        The step's common metadata, unchanged.
    groups:
        The step's requests, grouped by query length (decodes form one group).
    num_actual_tokens:
        Real tokens; rows past it are padding.
    """

    common: CommonAttentionMetadata
    groups: tuple[RequestGroup, ...]
    num_actual_tokens: int


def _chunks(reqs: list[int], query_len: int, seq_lens: list[int]) -> list[list[int]]:
    """Split `reqs` so that each chunk's score tensor stays under MAX_GROUP_SCORES."""
    chunks: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for r in reqs:
        grown = max(longest, seq_lens[r])
        if current and (len(current) + 1) * query_len * grown > MAX_GROUP_SCORES:
            chunks.append(current)
            current, grown = [], seq_lens[r]
        current.append(r)
        longest = grown
    if current:
        chunks.append(current)
    return chunks


class ReferenceMetadataBuilder(MetadataBuilder[ReferenceMetadata]):
    """Groups requests by query length and computes each group's KV slots once per step."""

    reorder_batch_threshold: ClassVar[int] = 1

    def __init__(
        self, kv_cache_spec: AttentionSpec, layer_names: Sequence[str], device: torch.device
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, device)
        self.block_size = kv_cache_spec.block_size

    def build(
        self, common: CommonAttentionMetadata, *, common_prefix_len: int = 0
    ) -> ReferenceMetadata:
        """Plan the step.

        Parameters
        ----------
        common:
            The step's common metadata; only its CPU copies are read on the host, so building
            never synchronises with the device.
        common_prefix_len:
            Checked (`check_common_prefix_len`), then computed the plain way: the reference
            is the oracle that cascade attention must equal.

        Returns
        -------
        ReferenceMetadata
        """
        check_common_prefix_len(
            common_prefix_len,
            block_size=self.block_size,
            context_lens=common.context_lens_cpu[: common.num_reqs].tolist(),
        )
        starts = common.query_start_loc_cpu.tolist()
        seq_lens = common.seq_lens_cpu.tolist()
        query_lens = [starts[i + 1] - starts[i] for i in range(common.num_reqs)]
        for i, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
            if q < 0 or s < q:
                raise ValueError(
                    f"request {i}: query length {q} and seq_len {s} are inconsistent; "
                    "seq_lens must count history plus the new tokens (seq_len >= query_len >= 0)"
                )
        by_len: dict[int, list[int]] = defaultdict(list)
        for i, q in enumerate(query_lens):
            if q > 0:
                by_len[q].append(i)
        groups = []
        for q_len, reqs in sorted(by_len.items()):
            for chunk in _chunks(reqs, q_len, seq_lens):
                groups.append(self._group(common, chunk, q_len, starts, seq_lens))
        return ReferenceMetadata(
            common=common, groups=tuple(groups), num_actual_tokens=common.num_actual_tokens
        )

    def _group(
        self,
        common: CommonAttentionMetadata,
        reqs: list[int],
        query_len: int,
        starts: list[int],
        seq_lens: list[int],
    ) -> RequestGroup:
        device = common.block_table.device
        bsz = self.block_size
        longest = max(seq_lens[r] for r in reqs)
        num_blocks = -(-longest // bsz)
        if num_blocks > common.block_table.shape[1]:
            raise ValueError(
                f"block_table has {common.block_table.shape[1]} columns but a request of "
                f"{longest} tokens needs {num_blocks} blocks of {bsz}"
            )
        rows = torch.tensor(
            [starts[r] + i for r in reqs for i in range(query_len)], dtype=torch.int64
        ).to(device)
        req_ids = torch.tensor(reqs, dtype=torch.int64).to(device)
        lens = torch.tensor([seq_lens[r] for r in reqs], dtype=torch.int64).to(device)
        pos = torch.arange(num_blocks * bsz, device=device)
        blocks = common.block_table.index_select(0, req_ids)[:, pos // bsz].to(torch.int64)
        slots = blocks * bsz + pos % bsz
        slots = torch.where(pos[None, :] < lens[:, None], slots, 0)[:, :longest]
        return RequestGroup(
            token_rows=rows,
            slots=slots.contiguous(),
            seq_lens=lens,
            num_reqs=len(reqs),
            query_len=query_len,
        )
