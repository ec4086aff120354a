"""A plain-torch attention oracle (float32) used by this package's GPU checks and benchmarks.

It follows the conventions of `pagedcore.attention.backend` literally, on unpaged tensors, so
a disagreement with the kernels is a kernel (or layout) bug.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["attention_reference"]


def attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    alibi_slopes: Sequence[float] | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Attention of one request's new tokens over its whole sequence, in float32.

    Parameters
    ----------
    query:
        ``[q_len, Hq, D]``; the last `q_len` positions of the sequence.
    key, value:
        ``[seq_len, Hkv, D]``, every position of the sequence.

    Returns
    -------
    torch.Tensor
        ``[q_len, Hq, D]`` float32.
    """
    import torch

    q_len, hq, _ = query.shape
    seq_len, hkv, _ = key.shape
    group = hq // hkv
    k = key.float().repeat_interleave(group, dim=1)
    v = value.float().repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", query.float(), k) * scale
    if logits_soft_cap is not None:
        s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
    pos_q = torch.arange(seq_len - q_len, seq_len, device=query.device)
    pos_k = torch.arange(seq_len, device=query.device)
    if alibi_slopes is not None:
        slopes = torch.tensor(alibi_slopes, dtype=torch.float32, device=query.device)
        s = s + slopes[:, None, None] * (pos_k[None, :] - pos_q[:, None]).float()
    visible = torch.ones(q_len, seq_len, dtype=torch.bool, device=query.device)
    if causal:
        visible &= pos_k[None, :] <= pos_q[:, None]
    if sliding_window is not None:
        visible &= (pos_q[:, None] - pos_k[None, :]) < sliding_window
    s = s.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)
