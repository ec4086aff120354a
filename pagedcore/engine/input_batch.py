"""Flatten a scheduled step into `[T]` tensors and per-group attention metadata.

Persistent host buffers (pinned on CUDA) and device buffers are allocated once at their largest
size; each step fills a prefix of them, so preparing a step allocates almost nothing.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import attrs
import numpy as np

from pagedcore.attention.metadata import CommonAttentionMetadata, decode_first_order
from pagedcore.kv_cache.spec import cdiv

if TYPE_CHECKING:
    import torch

    from pagedcore.engine.scheduler import ScheduledRequest

__all__ = ["InputBatch", "StepInputs"]


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
        The `ScheduledRequest` behind each logits row.
    order:
        The scheduled requests in batch (decode-first) order.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    common: tuple[CommonAttentionMetadata, ...]
    logits_indices: torch.Tensor
    sample_rows: tuple[ScheduledRequest, ...]
    order: tuple[ScheduledRequest, ...]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


class _Buffer:
    """A host array (pinned torch storage on CUDA) mirrored by a device tensor."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device) -> None:
        import torch

        pin = device.type == "cuda"
        self.host = torch.zeros(size, dtype=dtype, pin_memory=pin)
        self.np = self.host.numpy()
        self.device = self.host if device.type == "cpu" else torch.zeros(
            size, dtype=dtype, device=device
        )

    def upload(self, n: int, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """Copy the first `n` host elements to the device; return the device view."""
        if self.device is not self.host:
            self.device[:n].copy_(self.host[:n], non_blocking=True)
        out = self.device[:n]
        return out if shape is None else out.view(shape)

    def host_view(self, n: int, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        out = self.host[:n]
        return out if shape is None else out.view(shape)


class InputBatch:
    """Builds `StepInputs` from a scheduler step.

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
    ) -> None:
        import torch

        self.device = device
        self.block_sizes = list(block_sizes)
        self.decode_threshold = decode_threshold
        self.max_blocks = [cdiv(max_model_len, b) for b in self.block_sizes]
        t = max_num_batched_tokens
        self._ids = _Buffer(t, torch.int64, device)
        self._pos = _Buffer(t, torch.int64, device)
        self._qsl = _Buffer(max_num_seqs + 1, torch.int32, device)
        self._seq = _Buffer(max_num_seqs, torch.int32, device)
        self._logit_rows = _Buffer(max_num_seqs, torch.int64, device)
        self._slots = [_Buffer(t, torch.int64, device) for _ in self.block_sizes]
        self._tables = [_Buffer(max_num_seqs * m, torch.int32, device) for m in self.max_blocks]

    def prepare(
        self,
        scheduled: Sequence[ScheduledRequest],
        block_ids: Callable[[str], tuple[list[int], ...]],
    ) -> StepInputs:
        """Flatten `scheduled`, reading each request's block ids through `block_ids`."""
        order_idx = decode_first_order([s.num_new_tokens for s in scheduled], self.decode_threshold)
        order = [scheduled[i] for i in order_idx]
        num_reqs = len(order)
        query_lens = np.fromiter((s.num_new_tokens for s in order), np.int64, num_reqs)
        starts = np.fromiter((s.start for s in order), np.int64, num_reqs)
        cu = np.zeros(num_reqs + 1, np.int64)
        np.cumsum(query_lens, out=cu[1:])
        num_tokens = int(cu[-1])
        if num_tokens > self._ids.np.shape[0] or num_reqs + 1 > self._qsl.np.shape[0]:
            raise ValueError(
                f"step of {num_tokens} tokens / {num_reqs} requests exceeds the batch limits "
                f"({self._ids.np.shape[0]} tokens, {self._qsl.np.shape[0] - 1} requests)"
            )

        flat = itertools.chain.from_iterable(
            s.request.all_token_ids[s.start : s.end] for s in order
        )
        self._ids.np[:num_tokens] = np.fromiter(flat, np.int64, num_tokens)
        req_of_token = np.repeat(np.arange(num_reqs), query_lens)
        positions = np.arange(num_tokens) - cu[req_of_token] + starts[req_of_token]
        self._pos.np[:num_tokens] = positions
        self._qsl.np[: num_reqs + 1] = cu
        seq_lens = starts + query_lens
        self._seq.np[:num_reqs] = seq_lens

        sample_rows = tuple(s for s in order if s.samples)
        rows = [int(cu[i + 1]) - 1 for i, s in enumerate(order) if s.samples]
        self._logit_rows.np[: len(rows)] = rows

        input_ids = self._ids.upload(num_tokens)
        pos_dev = self._pos.upload(num_tokens)
        qsl_dev = self._qsl.upload(num_reqs + 1)
        seq_dev = self._seq.upload(num_reqs)
        qsl_cpu = self._qsl.host_view(num_reqs + 1).clone()
        seq_cpu = self._seq.host_view(num_reqs).clone()
        per_request_ids = [block_ids(s.request.request_id) for s in order]
        common: list[CommonAttentionMetadata] = []
        for g, block_size in enumerate(self.block_sizes):
            lists = [ids[g] for ids in per_request_ids]
            width = max(1, max((len(b) for b in lists), default=1))
            table = self._tables[g].np[: num_reqs * width].reshape(num_reqs, width)
            table.fill(0)
            for i, b in enumerate(lists):
                table[i, : len(b)] = b
            slots = self._slots[g].np
            slots[:num_tokens] = (
                table[req_of_token, positions // block_size].astype(np.int64) * block_size
                + positions % block_size
            )
            common.append(
                CommonAttentionMetadata(
                    query_start_loc=qsl_dev,
                    query_start_loc_cpu=qsl_cpu,
                    seq_lens=seq_dev,
                    seq_lens_cpu=seq_cpu,
                    num_reqs=num_reqs,
                    num_actual_tokens=num_tokens,
                    max_query_len=int(query_lens.max()) if num_reqs else 0,
                    max_seq_len=int(seq_lens.max()) if num_reqs else 0,
                    block_table=self._tables[g].upload(num_reqs * width, (num_reqs, width)),
                    slot_mapping=self._slots[g].upload(num_tokens),
                    positions=pos_dev,
                    causal=True,
                )
            )
        return StepInputs(
            input_ids=input_ids,
            positions=pos_dev,
            common=tuple(common),
            logits_indices=self._logit_rows.upload(len(rows)),
            sample_rows=sample_rows,
            order=tuple(order),
        )
