"""TEST DOUBLE of FlashInfer's paged wrappers (flashinfer-python 0.7.2, NHD layout).

This is NOT FlashInfer. It is a slow, dense, float64, pure-torch implementation of what
FlashInfer documents for ``BatchDecodeWithPagedKVCacheWrapper`` and
``BatchPrefillWithPagedKVCacheWrapper`` (``flashinfer/decode.py``, ``flashinfer/prefill.py``),
written from FlashInfer's CSR page arrays (``indptr`` / ``indices`` / ``last_page_len``), never
from pagedcore's block table, so that the adapter's planning arithmetic is checked by the
answer. It raises ``RuntimeError`` where the real wrappers would reject an argument (dtypes,
shapes, layout, plan-before-run, query rows vs plan) and records every plan and run.
"""

from __future__ import annotations

from typing import Any

import torch

HEAD_DIMS = (64, 128, 256)


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise RuntimeError(f"[flashinfer test double] {message}")


def _as_dtype(value: Any) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    return {"float16": torch.float16, "bfloat16": torch.bfloat16}[str(value)]


class _PagedWrapper:
    """What both wrappers share: the constructor, the plan checks and the dense math."""

    kind = ""

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 **kwargs: Any) -> None:
        _check(kv_layout == "NHD", f"this adapter must ask for NHD, got {kv_layout!r}")
        _check(float_workspace_buffer.dtype == torch.uint8, "workspace must be a uint8 buffer")
        self.kwargs = kwargs
        self.plans: list[dict[str, Any]] = []
        self.runs: list[dict[str, Any]] = []
        self._plan: dict[str, Any] | None = None
        REGISTRY.append(self)

    def _plan_common(self, qo_indptr: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor,
                     last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int,
                     head_dim: int, page_size: int, **kwargs: Any) -> None:
        for name, t in (("indptr", indptr), ("indices", indices),
                        ("last_page_len", last_page_len), ("qo_indptr", qo_indptr)):
            _check(t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}")
            _check(t.dim() == 1 and t.is_contiguous(), f"{name} must be a contiguous 1-D tensor")
        batch = indptr.numel() - 1
        _check(batch >= 1, "batch size must be positive")
        _check(qo_indptr.numel() == batch + 1, "qo_indptr and indptr must describe one batch")
        _check(last_page_len.numel() == batch, "last_page_len must be [batch_size]")
        _check(int(indptr[0]) == 0 and int(qo_indptr[0]) == 0, "indptr must start at 0")
        _check(indices.numel() == int(indptr[-1]), "indices must hold indptr[-1] pages")
        pages = (indptr[1:] - indptr[:-1]).tolist()
        lasts = last_page_len.tolist()
        for p, last in zip(pages, lasts, strict=True):
            _check(p >= 0, "indptr must be non-decreasing")
            _check((p == 0 and last == 0) or 1 <= last <= page_size,
                   f"last_page_len {last} out of [1, {page_size}] for {p} pages")
        _check(num_qo_heads % num_kv_heads == 0, "num_qo_heads must be a multiple of kv heads")
        _check(head_dim in HEAD_DIMS, f"head_dim {head_dim} has no kernel")
        _check(kwargs.get("window_left", -1) >= -1, "window_left must be >= -1")
        q_dtype = _as_dtype(kwargs.get("q_data_type", "float16"))
        kv_dtype = _as_dtype(kwargs.get("kv_data_type") or q_dtype)
        _check(q_dtype in (torch.float16, torch.bfloat16), "q dtype must be fp16/bf16")
        plan = dict(qo_indptr=qo_indptr.cpu().long(), indptr=indptr.cpu().long(),
                    indices=indices.long(), last_page_len=last_page_len.cpu().long(),
                    num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                    page_size=page_size, q_dtype=q_dtype, kv_dtype=kv_dtype, **kwargs)
        self.plans.append(plan)
        self._plan = plan

    def run(self, q: torch.Tensor, paged_kv_cache: torch.Tensor, *,
            out: torch.Tensor | None = None) -> torch.Tensor:
        plan = self._plan
        _check(plan is not None, "run() before plan()")
        assert plan is not None
        self.runs.append(dict(q=q, out=out))
        hq, hkv, d, page = (plan["num_qo_heads"], plan["num_kv_heads"], plan["head_dim"],
                            plan["page_size"])
        total_q = int(plan["qo_indptr"][-1])
        _check(tuple(q.shape) == (total_q, hq, d),
               f"q must be [{total_q}, {hq}, {d}] as planned, got {tuple(q.shape)}")
        _check(q.dtype == plan["q_dtype"], f"q is {q.dtype} but the plan said {plan['q_dtype']}")
        _check(q.stride(-1) == 1, "q must have a contiguous last dimension")
        kv = paged_kv_cache
        _check(kv.dim() == 5 and kv.shape[1] == 2 and tuple(kv.shape[2:]) == (page, hkv, d),
               f"NHD paged cache must be [pages, 2, {page}, {hkv}, {d}], got {tuple(kv.shape)}")
        _check(kv.dtype == plan["kv_dtype"], "cache dtype differs from the planned kv dtype")
        _check(kv.is_contiguous(), "paged cache must be contiguous")
        if out is not None:
            _check(out.shape == q.shape and out.dtype == q.dtype, "out must match q")
        result = self._attend(q, kv, plan).to(q.dtype)
        if out is None:
            return result
        out.copy_(result)
        return out

    def _attend(self, q: torch.Tensor, kv: torch.Tensor, plan: dict[str, Any]) -> torch.Tensor:
        group = plan["num_qo_heads"] // plan["num_kv_heads"]
        page, scale = plan["page_size"], plan["sm_scale"]
        cap, left = plan.get("logits_soft_cap"), plan.get("window_left", -1)
        causal = plan.get("causal", True)
        qo, ind, last = plan["qo_indptr"].tolist(), plan["indptr"].tolist(), plan["last_page_len"]
        result = torch.zeros(q.shape, dtype=torch.float64)
        for b in range(len(qo) - 1):
            pages = plan["indices"][ind[b] : ind[b + 1]].cpu()
            sk = 0 if len(pages) == 0 else (len(pages) - 1) * page + int(last[b])
            j = torch.arange(sk)
            blocks = pages[j // page]
            keys = kv[blocks, 0, j % page].double().repeat_interleave(group, dim=1)
            vals = kv[blocks, 1, j % page].double().repeat_interleave(group, dim=1)
            qb = q[qo[b] : qo[b + 1]].double()
            sq = qb.shape[0]
            s = torch.einsum("ihd,jhd->hij", qb, keys) * scale
            if cap is not None and cap > 0:
                s = cap * torch.tanh(s / cap)
            rel = (torch.arange(sq)[:, None] + sk - sq) - j[None, :]
            visible = torch.ones(sq, sk, dtype=torch.bool)
            if causal:
                visible &= rel >= 0
            if left >= 0:
                visible &= rel <= left
            s = torch.where(visible[None], s, torch.tensor(float("-inf"), dtype=s.dtype))
            probs = torch.softmax(s, dim=-1)
            probs = torch.where(visible.any(-1)[None, :, None], probs, 0.0)
            result[qo[b] : qo[b + 1]] = torch.einsum("hij,jhd->ihd", probs, vals)
        return result


class BatchDecodeWithPagedKVCacheWrapper(_PagedWrapper):
    """Decode: one query token per request, the whole history visible (subject to window)."""

    kind = "decode"

    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor,
             num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
             **kwargs: Any) -> None:
        _check("causal" not in kwargs, "the decode wrapper's plan() takes no causal argument")
        batch = indptr.numel() - 1
        qo = torch.arange(batch + 1, dtype=torch.int32)
        self._plan_common(qo, indptr, indices, last_page_len, num_qo_heads, num_kv_heads,
                          head_dim, page_size, **kwargs)


class BatchPrefillWithPagedKVCacheWrapper(_PagedWrapper):
    """Prefill/append: query rows aligned to the end of each request's KV (bottom-right)."""

    kind = "prefill"

    def plan(self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor,
             paged_kv_indices: torch.Tensor, paged_kv_last_page_len: torch.Tensor,
             num_qo_heads: int, num_kv_heads: int, head_dim_qk: int, page_size: int,
             **kwargs: Any) -> None:
        self._plan_common(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                          num_qo_heads, num_kv_heads, head_dim_qk, page_size, **kwargs)


#: Every wrapper the double made, in order (tests clear it).
REGISTRY: list[_PagedWrapper] = []


class FakeFlashInfer:
    """Stands in for the ``flashinfer`` module."""

    BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
