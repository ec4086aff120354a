"""Flatten a scheduled step into `[T]` tensors and per-group attention metadata.

Persistent host buffers (pinned on CUDA) and device buffers are allocated once at their largest
size; each step fills a prefix of them, so preparing a step allocates almost nothing. Block
tables are always ``max_blocks`` wide and a row is rewritten only when the request in it has
other blocks than last step. A step of single-token decodes can be padded to a CUDA-graph
bucket (`prepare(..., pad_to=...)`): its inputs then land in the buffers exactly where the
bucket's captured graph reads them (`graph_common`, `graph_inputs`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import attrs
import numpy as np

from pagedcore.attention.metadata import CommonAttentionMetadata, decode_first_order
from pagedcore.engine.runner import decode_inputs
from pagedcore.engine.runner.prompt_rows import plan_prompt_rows
from pagedcore.engine.runner.step_buffers import StepBuffers, StepInputs
from pagedcore.engine.scheduling.request import token_slice
from pagedcore.engine.scheduling.scheduler_types import DecodeBatch

if TYPE_CHECKING:
    import torch

    from pagedcore.engine.scheduling.scheduler import ScheduledRequest

__all__ = ["InputBatch", "StepInputs"]


class InputBatch(StepBuffers):
    """Builds `StepInputs` from a scheduler step (the buffers and their parameters: see
    `StepBuffers`)."""

    # ---- the step -------------------------------------------------------------------------

    def prepare(
        self,
        scheduled: Sequence[ScheduledRequest],
        block_ids: Callable[[str], tuple[list[int], ...]],
        *,
        pad_to: int | None = None,
    ) -> StepInputs:
        """Flatten `scheduled`, reading each request's block ids through `block_ids`.

        Parameters
        ----------
        scheduled:
            The step's requests (any order; decodes are moved first).
        block_ids:
            Block ids per KV-cache group of a request id.
        pad_to:
            For a CUDA-graph step: every request has one query token and the batch is padded
            with padding requests to `pad_to` requests, laid out in the persistent buffers
            exactly as `graph_common` describes them (block tables ``max_blocks`` wide).
        """
        if pad_to is not None:
            return self._prepare_padded_decode(scheduled, block_ids, pad_to)
        if isinstance(scheduled, DecodeBatch):
            return self._prepare_decode(scheduled, block_ids)
        order_idx = decode_first_order([s.num_new_tokens for s in scheduled], self.decode_threshold)
        order = [scheduled[i] for i in order_idx]
        num_reqs = len(order)
        query_lens = np.fromiter((s.num_new_tokens for s in order), np.int64, num_reqs)
        starts = np.fromiter((s.start for s in order), np.int64, num_reqs)
        cu = np.zeros(num_reqs + 1, np.int64)
        np.cumsum(query_lens, out=cu[1:])
        num_tokens = int(cu[-1])
        if num_tokens > self._max_num_tokens or num_reqs > self._max_num_seqs:
            raise ValueError(
                f"step of {num_tokens} tokens / {num_reqs} requests exceeds the batch limits "
                f"({self._max_num_tokens} tokens, {self._max_num_seqs} requests)"
            )

        flat = itertools.chain.from_iterable(
            token_slice(s.request, s.start, s.end) for s in order
        )
        self._ids.np[:num_tokens] = np.fromiter(flat, np.int64, num_tokens)
        req_of_token = np.repeat(np.arange(num_reqs), query_lens)
        positions = np.arange(num_tokens) - cu[req_of_token] + starts[req_of_token]
        self._pos.np[:num_tokens] = positions
        self._qsl.np[: num_reqs + 1] = cu
        seq_lens = starts + query_lens
        self._seq.np[:num_reqs] = seq_lens
        self._row_reqs = None
        tables, _lo, _hi = self._fill_tables([block_ids(s.request.request_id) for s in order])
        self._write_slots(tables, req_of_token, positions)
        inputs = self._finish(
            order,
            num_reqs=num_reqs,
            num_tokens=num_tokens,
            widths=self.max_blocks,
            max_query_len=int(query_lens.max()) if num_reqs else 0,
            max_seq_len=int(seq_lens.max()) if num_reqs else 0,
            sample_rows=[int(cu[i + 1]) - 1 for i, s in enumerate(order) if s.samples],
            bucket=None,
        )
        prompt_rows = plan_prompt_rows(order, cu, self.device)
        return inputs if prompt_rows is None else attrs.evolve(inputs, prompt_rows=prompt_rows)

    def _prepare_decode(
        self, batch: DecodeBatch, block_ids: Callable[[str], tuple[list[int], ...]]
    ) -> StepInputs:
        return decode_inputs.prepare_decode(self, batch, block_ids)

    def _prepare_padded_decode(
        self,
        scheduled: Sequence[ScheduledRequest],
        block_ids: Callable[[str], tuple[list[int], ...]],
        bucket: int,
    ) -> StepInputs:
        return decode_inputs.prepare_padded_decode(self, scheduled, block_ids, bucket)

    def _bucket_views(
        self, bucket: int
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[CommonAttentionMetadata, ...]]:
        return decode_inputs.bucket_views(self, bucket)
