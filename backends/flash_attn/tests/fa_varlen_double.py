"""TEST DOUBLE of ``flash_attn.flash_attn_varlen_func`` (flash-attn 2.6.2+, paged KV).

This is NOT FlashAttention. It is a slow, dense, float64, pure-torch implementation of the
behaviour FlashAttention documents for ``flash_attn_varlen_func`` with a ``block_table``
(docstring of ``flash_attn/flash_attn_interface.py`` and the argument checks of
``mha_varlen_fwd`` in ``csrc/flash_attn/flash_api.cpp``, tags v2.6.2-v2.8.3), written in
flash-attn's own coordinates (query row ``i`` of ``seqlen_q``, key column ``j`` of ``seqlen_k``,
bottom-right aligned) so that the adapter's marshalling is checked against an independent
formula in pagedcore's coordinates (absolute positions) in the tests.

It raises ``RuntimeError`` wherever the real function's ``TORCH_CHECK`` would fail, and records
every call in `calls` so tests can inspect the arguments.
"""

from __future__ import annotations

from typing import Any

import torch


class VarlenDouble:
    """Callable test double; see the module docstring."""

    def __init__(self, *, causal_top_left: bool = False) -> None:
        #: Every call's keyword view of its arguments, in order.
        self.calls: list[dict[str, Any]] = []
        #: Mutant switch for harness self-tests: align the causal mask top-left (wrong).
        self.causal_top_left = causal_top_left

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        *,
        softmax_scale: float,
        causal: bool,
        window_size: tuple[int, int],
        softcap: float,
        alibi_slopes: torch.Tensor | None,
        block_table: torch.Tensor,
    ) -> torch.Tensor:
        self.calls.append(
            dict(
                q=q,
                k=k,
                v=v,
                cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k=cu_seqlens_k,
                max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k,
                softmax_scale=softmax_scale,
                causal=causal,
                window_size=window_size,
                softcap=softcap,
                alibi_slopes=alibi_slopes,
                block_table=block_table,
            )
        )
        self._check(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            alibi_slopes,
            block_table,
        )
        num_heads, num_kv_heads = q.shape[1], k.shape[2]
        group = num_heads // num_kv_heads
        page = k.shape[1]
        left, right = window_size
        if causal:
            right = 0  # mha_varlen_fwd: `if (is_causal) { window_size_right = 0; }`
        if left >= max_seqlen_k:
            left = -1
        if right >= max_seqlen_k:
            right = -1
        out = torch.empty(q.shape, dtype=torch.float64)
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        for b in range(len(cq) - 1):
            sq, sk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
            j = torch.arange(sk)
            blocks = block_table[b, j // page].long()
            keys = k[blocks, j % page].double()  # [sk, Hkv, D]
            vals = v[blocks, j % page].double()
            keys = keys.repeat_interleave(group, dim=1)
            vals = vals.repeat_interleave(group, dim=1)
            qb = q[cq[b] : cq[b + 1]].double()  # [sq, Hq, D]
            s = torch.einsum("ihd,jhd->hij", qb, keys) * softmax_scale
            if softcap > 0.0:
                s = softcap * torch.tanh(s / softcap)
            i = torch.arange(sq)[:, None]
            diag = i + (0 if self.causal_top_left else sk - sq)  # key column of query i
            rel = diag - j[None, :]  # >= 0: key at or before the query
            if alibi_slopes is not None:
                slopes = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b]
                s = s - slopes.double()[:, None, None] * rel.abs()[None].double()
            visible = torch.ones(sq, sk, dtype=torch.bool)
            if left >= 0:
                visible &= rel <= left
            if right >= 0:
                visible &= rel >= -right
            s = torch.where(visible[None], s, torch.tensor(float("-inf"), dtype=s.dtype))
            probs = torch.softmax(s, dim=-1)
            # A row with no visible key is all -inf: flash-attn returns zeros there. Only those
            # rows are cleared, so NaN read from poisoned slots still propagates.
            probs = torch.where(visible.any(-1)[None, :, None], probs, 0.0)
            out[cq[b] : cq[b + 1]] = torch.einsum("hij,jhd->ihd", probs, vals)
        return out.to(q.dtype)

    @staticmethod
    def _check(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        alibi_slopes: torch.Tensor | None,
        block_table: torch.Tensor,
    ) -> None:
        def check(cond: bool, message: str) -> None:
            if not cond:
                raise RuntimeError(f"[flash-attn test double] {message}")

        check(q.dtype in (torch.float16, torch.bfloat16), "only fp16 and bf16 are supported")
        check(k.dtype == q.dtype and v.dtype == q.dtype, "q, k, v must share one dtype")
        check(cu_seqlens_q.dtype == torch.int32, "cu_seqlens_q must have dtype int32")
        check(cu_seqlens_k.dtype == torch.int32, "cu_seqlens_k must have dtype int32")
        check(
            cu_seqlens_q.is_contiguous() and cu_seqlens_k.is_contiguous(),
            "cu_seqlens must be contiguous",
        )
        check(block_table.dtype == torch.int32, "block_table must have dtype torch.int32")
        check(block_table.stride(-1) == 1, "block_table must have contiguous last dimension")
        for t in (q, k, v):
            check(t.stride(-1) == 1, "Input tensor must have contiguous last dimension")
        check(
            q.dim() == 3 and k.dim() == 4 and v.shape == k.shape,
            f"paged k/v must be [num_blocks, page, Hkv, D]; got {k.shape}, {v.shape}",
        )
        batch = cu_seqlens_q.numel() - 1
        check(batch > 0, "batch size must be positive")
        check(k.shape[1] % 256 == 0, "Paged KV cache block size must be divisible by 256")
        head_size = q.shape[2]
        check(head_size <= 256 and head_size % 8 == 0, "head_size must be <= 256, multiple of 8")
        check(k.shape[3] == head_size, "k/v head size must match q")
        check(q.shape[1] % k.shape[2] == 0, "kv heads must divide query heads")
        check(cu_seqlens_k.shape == (batch + 1,), "cu_seqlens_k must be [batch_size + 1]")
        check(
            block_table.dim() == 2 and block_table.shape[0] == batch,
            "block_table must be [batch_size, max_num_blocks_per_seq]",
        )
        q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
        k_lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist()
        # Stricter than flash-attn in general, but exactly what its single-token GQA decode
        # path (q.reshape({batch_size, ...})) needs: q holds the batch's tokens and no more.
        check(q.shape[0] == int(cu_seqlens_q[-1]), "q rows must equal cu_seqlens_q[-1]")
        check(min(q_lens) >= 0 and min(k_lens) >= 0, "cu_seqlens must be non-decreasing")
        check(max_seqlen_q >= max(q_lens), "max_seqlen_q smaller than a query length")
        check(max_seqlen_k >= max(k_lens), "max_seqlen_k smaller than a key length")
        check(max(k_lens) <= block_table.shape[1] * k.shape[1], "block_table too narrow")
        if alibi_slopes is not None:
            check(alibi_slopes.dtype == torch.float32, "ALiBi slopes must have dtype fp32")
            check(
                alibi_slopes.shape in ((q.shape[1],), (batch, q.shape[1])),
                "ALiBi slopes tensor must have shape (nheads) or (batch_size, nheads)",
            )
