"""A prepared attention launch: what `pagedcore_triton.ops` plans once per step and layer shape."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    import torch

    from pagedcore_triton.plan import LaunchPart

__all__ = ["PreparedLaunch", "cache_strides", "part_tensors"]


@attrs.frozen(kw_only=True, eq=False)
class PreparedLaunch:
    """Everything of one attention launch that does not change from layer to layer.

    Attributes
    ----------
    grid:
        ``(q_blocks, Hkv, segments)``, or ``(P, Hkv, 1)`` for a flat part
        (`LaunchPart.flat_programs`) or a balanced one (`LaunchPart.balanced_programs`);
        None when the part has no tokens (nothing to launch).
    qsl, seq_lens, block_table:
        The part's ``[n + 1]``, ``[n]`` and ``[n, max_blocks]`` int32 views of the step's
        buffers.
    part_acc, part_ml:
        Split-KV partials ``[Tp, Hq, S, HEAD_PAD]`` and ``[Tp, Hq, S, 2]`` float32 (shared by
        the layers of a step, which run one after the other), or None without a split; for a
        balanced part ``[P, Hq, HEAD_PAD]`` and ``[P, Hq, 2]``.
    static_args:
        Positional scalar arguments after the step's tensors.
    constexprs:
        The kernel's compile-time arguments and launch options.
    info:
        A balanced part's split-request table, ``[1 + 3 * G]`` int32 (see
        ``kernels/balanced.py``); None otherwise.
    kernel:
        ``"paged"`` (``kernels/attention.py``) or ``"fp8_decode"`` (``kernels/decode_fp8.py``,
        single-token decodes over an fp8 cache).
    """

    grid: tuple[int, int, int] | None
    qsl: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    part_acc: torch.Tensor | None
    part_ml: torch.Tensor | None
    num_reqs: int
    token_begin: int
    num_tokens: int
    static_args: tuple[Any, ...]
    constexprs: dict[str, Any]
    info: torch.Tensor | None = None
    kernel: str = "paged"


def part_tensors(
    part: LaunchPart, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
    block_table: torch.Tensor,
) -> dict[str, Any]:
    """`PreparedLaunch`'s ``qsl`` / ``seq_lens`` / ``block_table``: `part`'s views of the
    step's buffers (the table's rows made contiguous where they are not)."""
    table = block_table[part.req_begin : part.req_end]
    if table.stride(-1) != 1:
        table = table.contiguous()
    return {"qsl": query_start_loc[part.req_begin : part.req_end + 1],
            "seq_lens": seq_lens[part.req_begin : part.req_end], "block_table": table}


def cache_strides(kv_cache_shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """``(v_offset, stride_cb, stride_cs, stride_ch)`` in elements of a contiguous
    ``[2, num_blocks, block_size, Hkv, D]`` cache: V's distance from K, and the strides of a
    block, a slot and a KV head."""
    _, num_blocks, block_size, num_kv_heads, head_size = kv_cache_shape
    stride_cs = num_kv_heads * head_size
    return num_blocks * block_size * stride_cs, block_size * stride_cs, stride_cs, head_size
