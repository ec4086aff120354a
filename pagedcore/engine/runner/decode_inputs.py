"""The all-decode input paths of `InputBatch` (a `DecodeBatch`, eager or padded to a CUDA-graph
bucket): a few list passes and numpy ops, the engine's hints, one upload per step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import getitem
from typing import TYPE_CHECKING

import numpy as np

from pagedcore.engine.runner.host_buffers import index_in
from pagedcore.engine.runner.step_buffers import StepBuffers, StepInputs
from pagedcore.engine.scheduling.request import (
    Request,
    get_request_id,
    get_token_list,
    token_slice,
)
from pagedcore.engine.scheduling.scheduler_types import DecodeBatch

if TYPE_CHECKING:
    import torch

    from pagedcore.attention.metadata import CommonAttentionMetadata
    from pagedcore.engine.scheduling.scheduler_types import ScheduledRequest

__all__ = ["bucket_views", "decode_tables", "prepare_decode", "prepare_padded_decode"]


def prepare_decode(
    ib: StepBuffers, batch: DecodeBatch, block_ids: Callable[[str], tuple[list[int], ...]]
) -> StepInputs:
    """An eager all-decode step (what the general path gives for it, in a few list
    passes and numpy ops)."""
    n = len(batch)
    if n > ib._max_num_seqs or n > ib._max_num_tokens:
        raise ValueError(
            f"step of {n} tokens / {n} requests exceeds the batch limits "
            f"({ib._max_num_tokens} tokens, {ib._max_num_seqs} requests)"
        )
    reqs, start_list = batch.requests, batch.starts
    starts = np.array(start_list, np.int64)
    ib._ids.np[:n] = (batch.token_ids if batch.token_ids is not None
                        else list(map(getitem, map(get_token_list, reqs), start_list)))
    ib._pos.np[:n] = starts
    ib._qsl.np[: n + 1] = ib._arange[: n + 1]
    ib._seq.np[:n] = starts + 1
    tables, _lo, _hi = decode_tables(ib, batch, reqs, block_ids, num_rows=n)
    rows = ib._arange[:n]
    ib._write_slots(tables, rows, starts)
    return ib._finish(
        batch,
        num_reqs=n,
        num_tokens=n,
        widths=ib.max_blocks,
        max_query_len=1 if n else 0,
        max_seq_len=int(starts.max()) + 1 if n else 0,
        sample_rows=rows,
        bucket=None,
    )


def prepare_padded_decode(
    ib: StepBuffers,
    scheduled: Sequence[ScheduledRequest],
    block_ids: Callable[[str], tuple[list[int], ...]],
    bucket: int,
) -> StepInputs:
    """A decode step padded to `bucket` requests, written into the buffers the bucket's
    graph reads: a few list passes and numpy ops, one upload of the per-step buffers and
    one per group of the changed block-table rows; the metadata views are cached per
    bucket (they are the same tensors every step)."""
    n = len(scheduled)
    if n > bucket or bucket > ib._max_num_seqs:
        raise ValueError(
            f"cannot pad a decode batch of {n} requests to {bucket} (at most "
            f"{ib._max_num_seqs} requests)"
        )
    token_ids: list[int] | None = None
    if isinstance(scheduled, DecodeBatch):
        reqs, start_list = scheduled.requests, scheduled.starts
        token_ids = scheduled.token_ids
    else:
        if [s.num_new_tokens for s in scheduled].count(1) != n:
            raise ValueError("a padded (CUDA-graph) step needs every query length to be 1")
        reqs = [s.request for s in scheduled]
        start_list = [s.start for s in scheduled]
    starts = np.array(start_list, np.int64)
    # (Requests index like lists; a tensor-parallel worker's planned views do too.)
    ids = ib._ids.np
    ids[:n] = (token_ids if token_ids is not None
               else [token_slice(r, s, s + 1)[0] for r, s in zip(reqs, start_list, strict=True)]
               if any(getattr(r, "placeholder", None) is not None for r in reqs)
               else list(map(getitem, map(get_token_list, reqs), start_list)))
    ids[n:bucket] = 0
    ib._pos.np[:n] = starts
    ib._pos.np[n:bucket] = 0
    ib._qsl.np[: bucket + 1] = ib._arange[: bucket + 1]
    ib._seq.np[:n] = starts + 1
    ib._seq.np[n:bucket] = 1
    tables, lo, hi = decode_tables(ib, scheduled, reqs, block_ids, num_rows=bucket)
    rows = ib._arange[:n]
    for g, (table, block_size) in enumerate(zip(tables, ib.block_sizes, strict=True)):
        slots = ib._slots[g].np
        slots[:n] = (table[rows, starts // block_size].astype(np.int64) * block_size
                     + starts % block_size)
        slots[n:bucket] = -1
    sample_rows: Sequence[ScheduledRequest]
    if isinstance(scheduled, DecodeBatch):
        sample_rows = scheduled  # every decode samples
        ib._logit_rows.np[:n] = rows
    else:
        picked = [i for i, s in enumerate(scheduled) if s.samples]
        sample_rows = tuple([scheduled[i] for i in picked])
        ib._logit_rows.np[: len(picked)] = picked
    arena = ib._arena
    ib._upload_step()
    for offset, width in zip(ib._table_offsets, ib.max_blocks, strict=True):
        arena.upload_bytes(offset + lo * width * 4, offset + hi * width * 4)
    input_ids, positions, common = bucket_views(ib, bucket)
    return StepInputs(
        input_ids=input_ids,
        positions=positions,
        common=common,
        logits_indices=ib._logit_rows.device[: len(sample_rows)],
        sample_rows=sample_rows,
        order=scheduled if isinstance(scheduled, DecodeBatch) else tuple(scheduled),
        cudagraph_bucket=bucket,
    )


def bucket_views(
    ib: StepBuffers, bucket: int
) -> tuple[torch.Tensor, torch.Tensor, tuple[CommonAttentionMetadata, ...]]:
    """Input ids, positions and per-group metadata of a padded `bucket`-request decode
    step: views of the persistent buffers, made once per bucket."""
    views = ib._padded_views.get(bucket)
    if views is None:
        ids, pos = ib.graph_inputs(bucket)
        views = (ids, pos, ib.graph_common(bucket))
        ib._padded_views[bucket] = views
    return views


def decode_tables(
    ib: StepBuffers,
    batch: Sequence[ScheduledRequest],
    reqs: Sequence[Request],
    block_ids: Callable[[str], tuple[list[int], ...]],
    *,
    num_rows: int,
) -> tuple[list[np.ndarray], int, int]:
    """`_fill_tables` for a decode step. When the step is a `DecodeBatch` over the same
    request list (same objects, same order) as the step these rows were last written
    for, and it says which requests' block ids changed since (``changed``), only their
    rows are looked up and checked; otherwise every row is."""
    previous, ib._row_reqs = ib._row_reqs, None
    changed = batch.changed if isinstance(batch, DecodeBatch) else None
    if changed is None or previous is None or reqs != previous:
        # (`!=` on lists of the same objects compares pointers, reading no request.)
        out = ib._fill_tables(list(map(block_ids, map(get_request_id, reqs))), num_rows)
    else:
        if len(changed) > 4:  # (an identity index of the list beats a scan per request)
            where = {id(r): i for i, r in enumerate(reqs)}
            found = map(where.get, map(id, changed))
        else:
            found = map(index_in(reqs), changed)
        rows = sorted(i for i in found if i is not None)
        out = ib._fill_rows(rows, [block_ids(reqs[i].request_id) for i in rows],
                              len(reqs), num_rows)
    ib._row_reqs = reqs
    return out
