"""The persistent step buffers of the input batch, and `StepInputs`, what one step hands the model.

`StepBuffers` owns the pinned host buffers mirrored on the device (one `Arena`) and the
block-table, slot-mapping and upload helpers that every input path shares: the general path in
`pagedcore.engine.runner.input_batch` and the all-decode paths in
`pagedcore.engine.runner.decode_inputs`.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress
from operator import is_not
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from pagedcore.attention.metadata import CommonAttentionMetadata
from pagedcore.engine.runner.host_buffers import Arena
from pagedcore.engine.scheduling.request import Request
from pagedcore.engine.scheduling.scheduler_types import DecodeBatch
from pagedcore.kv_cache.spec import cdiv

if TYPE_CHECKING:
    import torch

    from pagedcore.engine.runner.prompt_rows import PromptRows
    from pagedcore.engine.scheduling.scheduler_types import ScheduledRequest

__all__ = ["StepBuffers", "StepInputs"]

@attrs.frozen(kw_only=True)
class StepInputs:
    """One step, ready for the model.

    Attributes
    ----------
    input_ids:
        ``[T]`` int64 on the device.
    positions:
        ``[T]`` int64 on the device.
    common:
        One `CommonAttentionMetadata` per KV-cache group, in group order.
    logits_indices:
        ``[S]`` int64 on the device: rows of the flattened batch whose logits are sampled.
    sample_rows:
        The `ScheduledRequest` behind each logits row (a `DecodeBatch` when the step is one).
    order:
        The scheduled requests in batch (decode-first) order (a tuple or a `DecodeBatch`).
    cudagraph_bucket:
        For a step padded to a CUDA-graph bucket: the bucket (``input_ids`` and the metadata
        cover ``bucket`` requests, the real ones first); None for an eager step.
    cascade_prefix_lens:
        Per group, the ``common_prefix_len`` the builders get (cascade attention; empty or
        zeros: none). A step that cascades runs eagerly (never from a CUDA graph).
    prompt_rows:
        The rows whose logits give prompt log-probabilities (computed after the sampled
        rows), or None.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    common: tuple[CommonAttentionMetadata, ...]
    logits_indices: torch.Tensor
    sample_rows: Sequence[ScheduledRequest]
    order: Sequence[ScheduledRequest]
    cudagraph_bucket: int | None = None
    cascade_prefix_lens: tuple[int, ...] = ()
    prompt_rows: PromptRows | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])



class StepBuffers:
    """The persistent buffers a step is flattened into (the base of `InputBatch`).

    Parameters
    ----------
    max_num_seqs, max_num_batched_tokens, max_model_len:
        Largest step and sequence; sizes the persistent buffers.
    block_sizes:
        Block size of each KV-cache group.
    device:
        Where the model runs.
    decode_threshold:
        Requests with at most this many new tokens go first (the builders'
        `reorder_batch_threshold`).
    mirror:
        Give the device buffers their own memory (None: unless the device is the CPU; True on
        the CPU in tests, so a missed upload shows).
    """

    def __init__(
        self,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        block_sizes: Sequence[int],
        device: torch.device,
        decode_threshold: int = 1,
        mirror: bool | None = None,
    ) -> None:
        import torch

        self.device = device
        self.block_sizes = list(block_sizes)
        self.decode_threshold = decode_threshold
        self.max_model_len = max_model_len
        self.max_blocks = [cdiv(max_model_len, b) for b in self.block_sizes]
        # A padded decode batch has as many tokens as requests: size the token buffers for
        # whichever is larger.
        t = max(max_num_batched_tokens, max_num_seqs)
        s = max_num_seqs
        groups = len(self.block_sizes)
        # The per-step buffers first (one upload covers them on a padded decode step), then
        # the block tables (uploaded by changed row range).
        self._arena = Arena(
            [(t, torch.int64), (t, torch.int64), (s + 1, torch.int32), (s, torch.int32),
             (s, torch.int64)]
            + [(t, torch.int64)] * groups
            + [(s * m, torch.int32) for m in self.max_blocks],
            device,
            mirror=mirror,
        )
        bufs = self._arena.buffers
        self._ids, self._pos, self._qsl, self._seq, self._logit_rows = bufs[:5]
        self._slots = bufs[5 : 5 + groups]
        self._tables = bufs[5 + groups :]
        #: Bytes of the arena before the first block table (the per-step buffers).
        self._step_bytes = self._arena.offsets[5 + groups]
        self._table_offsets = self._arena.offsets[5 + groups : 5 + 2 * groups]
        self._upload_step = self._arena.uploader(0, self._step_bytes)
        self._max_num_seqs = max_num_seqs
        self._max_num_tokens = max_num_batched_tokens
        # The block-id tuple each host block-table row holds (None: zeros). Holding the tuple
        # keeps its identity unique, so `is` tells whether a row must be rewritten.
        self._row_owner: list[tuple[list[int], ...] | None] = [None] * max_num_seqs
        # The request list of the decode step the rows were last written for (None: unknown).
        self._row_reqs: Sequence[Request] | None = None
        self._arange = np.arange(max_num_seqs + 1)
        #: Per bucket, the views a padded decode step hands out (`_bucket_views`).
        self._padded_views: dict[
            int, tuple[torch.Tensor, torch.Tensor, tuple[CommonAttentionMetadata, ...]]
        ] = {}

    def _fill_tables(
        self,
        ids: Sequence[tuple[list[int], ...]],
        num_rows: int | None = None,
    ) -> tuple[list[np.ndarray], int, int]:
        """Bring each group's persistent ``[rows, max_blocks]`` host block table up to date.

        ``ids[i]`` is the block-id tuple of row ``i``. Row ``i`` is rewritten only when it held
        a different tuple last step (the scheduler hands out a new tuple whenever a request's
        blocks change, and the running order is stable, so a decode step rewrites almost
        nothing). Rows past ``len(ids)`` (up to `num_rows`) are zero (the null block).

        Returns
        -------
        tuple
            The tables (numpy views of the host buffers), and the range ``[lo, hi)`` of rows
            rewritten (``lo >= hi`` when none was).
        """
        num_reqs = len(ids)
        num_rows = num_reqs if num_rows is None else num_rows
        # Rows whose tuple is not the one they hold (C-speed: `map` stops at len(ids)).
        changed = list(compress(range(num_reqs), map(is_not, ids, self._row_owner)))
        return self._fill_rows(changed, [ids[i] for i in changed], num_reqs, num_rows)

    def _fill_rows(
        self,
        rows: Sequence[int],
        ids: Sequence[tuple[list[int], ...]],
        num_reqs: int,
        num_rows: int,
    ) -> tuple[list[np.ndarray], int, int]:
        """Write block-id tuple ``ids[k]`` into row ``rows[k]`` where the row holds another
        one; zero the rows ``[num_reqs, num_rows)`` that hold any. Returns the tables and the
        range of rows rewritten (``lo >= hi``: none)."""
        tables = [
            self._tables[g].np[: num_rows * m].reshape(num_rows, m)
            for g, m in enumerate(self.max_blocks)
        ]
        owners = self._row_owner
        touched = []
        for i, row_ids in zip(rows, ids, strict=True):
            if owners[i] is row_ids:
                continue
            for table, row in zip(tables, row_ids, strict=True):
                n = len(row)
                table[i, :n] = row
                table[i, n:] = 0
            owners[i] = row_ids
            touched.append(i)
        for i in range(num_reqs, num_rows):
            if owners[i] is not None:
                for table in tables:
                    table[i] = 0
                owners[i] = None
                touched.append(i)
        if not touched:
            return tables, num_rows, 0
        return tables, min(touched), max(touched) + 1

    def _write_slots(self, tables: Sequence[Any], rows: Any, positions: Any) -> None:
        """Each group's slot mapping of the step's ``len(positions)`` tokens: token ``i`` of
        block-table row ``rows[i]`` at ``positions[i]`` (numpy int arrays)."""
        n = len(positions)
        for g, (table, block_size) in enumerate(zip(tables, self.block_sizes, strict=True)):
            self._slots[g].np[:n] = (
                table[rows, positions // block_size].astype(np.int64) * block_size
                + positions % block_size
            )

    def _finish(
        self,
        order: Sequence[ScheduledRequest],
        *,
        num_reqs: int,
        num_tokens: int,
        widths: Sequence[int],
        max_query_len: int,
        max_seq_len: int,
        sample_rows: Sequence[int] | np.ndarray,
        bucket: int | None,
    ) -> StepInputs:
        """Upload the filled host buffers and wrap them as `StepInputs`."""
        self._logit_rows.np[: len(sample_rows)] = sample_rows
        input_ids = self._ids.upload(num_tokens)
        pos_dev = self._pos.upload(num_tokens)
        qsl_dev = self._qsl.upload(num_reqs + 1)
        seq_dev = self._seq.upload(num_reqs)
        qsl_cpu = self._qsl.host_view(num_reqs + 1).clone()
        seq_cpu = self._seq.host_view(num_reqs).clone()
        common = tuple(
            CommonAttentionMetadata(
                query_start_loc=qsl_dev,
                query_start_loc_cpu=qsl_cpu,
                seq_lens=seq_dev,
                seq_lens_cpu=seq_cpu,
                num_reqs=num_reqs,
                num_actual_tokens=num_tokens,
                max_query_len=max_query_len,
                max_seq_len=max_seq_len,
                block_table=self._tables[g].upload(num_reqs * w, (num_reqs, w)),
                slot_mapping=self._slots[g].upload(num_tokens),
                positions=pos_dev,
                causal=True,
            )
            for g, w in enumerate(widths)
        )
        return StepInputs(
            input_ids=input_ids,
            positions=pos_dev,
            common=common,
            logits_indices=self._logit_rows.upload(len(sample_rows)),
            # (Every request of a DecodeBatch samples.)
            sample_rows=order if isinstance(order, DecodeBatch)
            else tuple([s for s in order if s.samples]),
            order=order if isinstance(order, DecodeBatch) else tuple(order),
            cudagraph_bucket=bucket,
        )

    # ---- CUDA graphs ----------------------------------------------------------------------

    def write_padding(self, bucket: int) -> None:
        """Fill the persistent buffers with a batch of `bucket` padding requests (seq_len 1,
        null-block rows, slot -1, input id 0, position 0): the batch graphs are captured on."""
        self._ids.np[:bucket] = 0
        self._pos.np[:bucket] = 0
        self._qsl.np[: bucket + 1] = np.arange(bucket + 1)
        self._seq.np[:bucket] = 1
        for g, m in enumerate(self.max_blocks):
            self._tables[g].np[: bucket * m] = 0
            self._slots[g].np[:bucket] = -1
        self._row_owner[:bucket] = [None] * bucket
        self._row_reqs = None
        self._ids.upload(bucket)
        self._pos.upload(bucket)
        self._qsl.upload(bucket + 1)
        self._seq.upload(bucket)
        for g, m in enumerate(self.max_blocks):
            self._tables[g].upload(bucket * m)
            self._slots[g].upload(bucket)

    def graph_inputs(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The persistent ``[bucket]`` int64 input-id and position buffers on the device."""
        return self._ids.device[:bucket], self._pos.device[:bucket]

    def graph_common(self, bucket: int) -> tuple[CommonAttentionMetadata, ...]:
        """Per group, the metadata of a `bucket`-request decode batch over the persistent
        buffers (what `MetadataBuilder.build_for_cudagraph_capture` receives): block tables
        ``[bucket, max_blocks]``, ``max_seq_len = max_model_len``."""
        qsl = self._qsl.device[: bucket + 1]
        seq = self._seq.device[:bucket]
        return tuple(
            CommonAttentionMetadata(
                query_start_loc=qsl,
                query_start_loc_cpu=self._qsl.host_view(bucket + 1),
                seq_lens=seq,
                seq_lens_cpu=self._seq.host_view(bucket),
                num_reqs=bucket,
                num_actual_tokens=bucket,
                max_query_len=1,
                max_seq_len=self.max_model_len,
                block_table=self._tables[g].device[: bucket * m].view(bucket, m),
                slot_mapping=self._slots[g].device[:bucket],
                positions=self._pos.device[:bucket],
                causal=True,
            )
            for g, m in enumerate(self.max_blocks)
        )
