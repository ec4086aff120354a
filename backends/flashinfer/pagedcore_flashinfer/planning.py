"""FlashInfer's paged-KV arrays from pagedcore's block table (the plan's arithmetic).

FlashInfer describes a batch's pages in CSR form: request ``b`` owns the pages
``indices[indptr[b]:indptr[b + 1]]`` (in order) and its last page holds
``last_page_len[b]`` tokens, so its KV length is
``(indptr[b + 1] - indptr[b] - 1) * page_size + last_page_len[b]``.
"""

from __future__ import annotations

import attrs
import torch

__all__ = ["WORKSPACE_BYTES", "PagedKV", "check_table_capacity", "paged_kv", "workspace"]


#: FlashInfer's recommended float workspace (split-KV partial results).
WORKSPACE_BYTES = 128 * 1024 * 1024


def workspace(device: torch.device) -> torch.Tensor:
    """A zeroed uint8 float workspace for FlashInfer's wrappers (128 MiB on CUDA, 1 MiB else)."""
    size = WORKSPACE_BYTES if device.type == "cuda" else 1024 * 1024
    return torch.zeros(size, dtype=torch.uint8, device=device)


def check_table_capacity(block_table: torch.Tensor, block_size: int, num_reqs: int,
                         max_seq_len: int) -> None:
    """Raise ValueError when the block table has too few columns for the longest sequence."""
    capacity = block_table.shape[1] * block_size
    if num_reqs > 0 and max_seq_len > capacity:
        raise ValueError(
            f"block_table has {block_table.shape[1]} columns of {block_size} tokens "
            f"({capacity} tokens) but max_seq_len is {max_seq_len}; the engine "
            "must give every request enough block-table columns for its whole sequence"
        )


@attrs.frozen(kw_only=True)
class PagedKV:
    """The CSR page description of a run of requests.

    Attributes
    ----------
    indptr:
        ``[B + 1]`` int32 on the CPU; ``0`` then the running sum of pages per request.
    indices:
        ``[indptr[-1]]`` int32 on the block table's device; physical block ids, request by
        request, in logical order.
    last_page_len:
        ``[B]`` int32 on the CPU; tokens in each request's last page, in ``[1, page_size]``
        (``0`` only for a request without any KV).
    """

    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor


def paged_kv(
    block_table: torch.Tensor, seq_lens_cpu: torch.Tensor, block_size: int, start: int, stop: int
) -> PagedKV:
    """FlashInfer's page arrays for requests ``start <= b < stop``.

    Parameters
    ----------
    block_table:
        ``[B, max_blocks]`` int32 on the step's device.
    seq_lens_cpu:
        ``[B]`` int32 on the CPU: KV length (history + this step's tokens) of each request.
    block_size:
        Tokens per block (FlashInfer's ``page_size``).
    start, stop:
        The run of requests to describe.

    Returns
    -------
    PagedKV
        The host arrays come from `seq_lens_cpu` alone; `indices` is gathered on the device
        with sizes known on the host, so no device-to-host copy happens.
    """
    seq_lens = seq_lens_cpu[start:stop].to(torch.int64)
    num_pages = (seq_lens + block_size - 1) // block_size
    indptr = torch.zeros(stop - start + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(num_pages, dim=0)
    last_page_len = torch.where(num_pages > 0, seq_lens - (num_pages - 1) * block_size, 0)
    total = int(indptr[-1])
    device = block_table.device
    rows = torch.repeat_interleave(
        torch.arange(start, stop, device=device), num_pages.to(device), output_size=total
    )
    cols = torch.arange(total, device=device) - indptr[:-1].to(device)[rows - start]
    indices = block_table[rows, cols].to(torch.int32)
    return PagedKV(
        indptr=indptr.to(torch.int32),
        indices=indices,
        last_page_len=last_page_len.to(torch.int32),
    )
