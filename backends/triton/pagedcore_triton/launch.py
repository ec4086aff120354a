"""A prepared attention launch: what `pagedcore_triton.ops` plans once per step and layer shape."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    import torch

__all__ = ["PreparedLaunch"]


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
