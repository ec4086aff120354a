"""TEST DOUBLE of FlashInfer's paged wrappers (flashinfer-python 0.7.2, NHD layout).

This is NOT FlashInfer. It is a slow, dense, float64, pure-torch implementation of what
FlashInfer documents for ``BatchDecodeWithPagedKVCacheWrapper``,
``BatchPrefillWithPagedKVCacheWrapper`` (``flashinfer/decode.py``, ``flashinfer/prefill.py``) and
``BatchMLAPagedAttentionWrapper`` (``flashinfer/mla/_batch_mla``),
written from FlashInfer's CSR page arrays (``indptr`` / ``indices`` / ``last_page_len``), never
from pagedcore's block table, so that the adapter's planning arithmetic is checked by the
answer. It raises ``RuntimeError`` where the real wrappers would reject an argument (dtypes,
shapes, layout, plan-before-run, query rows vs plan) and records every plan and run.
"""

from __future__ import annotations

from typing import Any

import torch

HEAD_DIMS = (64, 128, 256)
#: KV dtypes the FA2 templates take next to fp16/bf16 queries (read as their values).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


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
        _check(kv_dtype in (q_dtype, *FP8_DTYPES),
               f"kv dtype {kv_dtype} must be the q dtype or fp8 (e4m3 / e5m2)")
        # flashinfer.utils.is_fa3_backend_supported: FA3 takes an fp8 cache only with fp8 q.
        _check(not (self.kwargs.get("backend") == "fa3" and kv_dtype in FP8_DTYPES),
               "FA3 with an fp8 KV cache needs fp8 queries; use backend='fa2'")
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
        plan = self._from_graph_buffers(plan)
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

    def _from_graph_buffers(self, plan: dict[str, Any]) -> dict[str, Any]:
        """Graph mode: the kernels read the page arrays from the wrapper's fixed device
        buffers (what the last plan() wrote there), not from the host arrays of that plan."""
        return plan

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

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 **kwargs: Any) -> None:
        super().__init__(float_workspace_buffer, kv_layout, **kwargs)
        self.graph = bool(kwargs.get("use_cuda_graph", False))
        if self.graph:
            bufs = [kwargs.get(f"paged_kv_{n}_buffer") for n in ("indptr", "indices",
                                                                  "last_page_len")]
            _check(all(isinstance(b, torch.Tensor) and b.dtype == torch.int32 for b in bufs),
                   "cudagraph mode needs int32 indptr / indices / last_page_len buffers")
            self.buffers: tuple[torch.Tensor, ...] = tuple(bufs)  # type: ignore[arg-type]
            _check(self.buffers[0].numel() == self.buffers[2].numel() + 1,
                   "The size of paged_kv_indptr_buffer should be batch_size + 1")

    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor,
             num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
             **kwargs: Any) -> None:
        _check("causal" not in kwargs, "the decode wrapper's plan() takes no causal argument")
        batch = indptr.numel() - 1
        qo = torch.arange(batch + 1, dtype=torch.int32)
        self._plan_common(qo, indptr, indices, last_page_len, num_qo_heads, num_kv_heads,
                          head_dim, page_size, **kwargs)
        if self.graph:
            b_indptr, b_indices, b_last = self.buffers
            _check(batch == b_last.numel(),
                   f"cudagraph wrappers keep their batch size {b_last.numel()}, got {batch}")
            _check(indices.numel() <= b_indices.numel(), "indices overflow the indices buffer")
            b_indptr.copy_(indptr)
            b_indices[: indices.numel()].copy_(indices)
            b_last.copy_(last_page_len)

    def _from_graph_buffers(self, plan: dict[str, Any]) -> dict[str, Any]:
        if not self.graph:
            return plan
        b_indptr, b_indices, b_last = self.buffers
        indptr = b_indptr.cpu().long()
        return {**plan, "indptr": indptr, "indices": b_indices[: int(indptr[-1])].long(),
                "last_page_len": b_last.cpu().long()}


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
REGISTRY: list[Any] = []


class MLAPlanMetadata:
    """``flashinfer.mla.MLAPlanMetadata``: only the CSR form this adapter uses."""

    def __init__(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                 kv_indices: torch.Tensor, kv_len_arr: torch.Tensor) -> None:
        self.qo_indptr, self.kv_indptr = qo_indptr, kv_indptr
        self.kv_indices, self.kv_len_arr = kv_indices, kv_len_arr

    @classmethod
    def csr(cls, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
            kv_len_arr: torch.Tensor) -> MLAPlanMetadata:
        return cls(qo_indptr, kv_indptr, kv_indices, kv_len_arr)


#: The MLA widths FlashInfer 0.7.2's FA2 MLA kernels accept (``_fa_common.py``): the latent
#: width a multiple of 128, the rope width a multiple of 64.
def _mla_dims_ok(ckv: int, kpe: int) -> bool:
    return ckv > 0 and ckv % 128 == 0 and kpe % 64 == 0


class BatchMLAPagedAttentionWrapper:
    """``BatchMLAPagedAttentionWrapper``: keyword-only plan/run, packed query and cache.

    Plan: CSR metadata (int32; ``kv_len_arr[b]`` must fit the pages of request ``b``), widths
    the FA kernels build, fp16/bf16 with the KV dtype equal to the query dtype, causal.
    Run: ``query`` ``[T, H, L + R]`` with ``T = qo_indptr[-1]``, ``kv_cache``
    ``[N, page_size, L + R]``, ``out`` ``[T, H, L]``; output in float64 math from the CSR arrays.
    """

    kind = "mla"

    def __init__(self, float_workspace_buffer: torch.Tensor, use_cuda_graph: bool = False,
                 *, backend: str = "auto") -> None:
        _check(float_workspace_buffer.dtype == torch.uint8, "workspace must be a uint8 buffer")
        _check(backend in ("auto", "fa2", "fa3"), f"unknown MLA backend {backend!r}")
        self.backend = backend
        self.plans: list[dict[str, Any]] = []
        self.runs: list[dict[str, Any]] = []
        self._plan: dict[str, Any] | None = None
        REGISTRY.append(self)

    def plan(self, *, metadata: MLAPlanMetadata, num_heads: int, head_dim_ckv: int,
             head_dim_kpe: int, page_size: int, causal: bool, sm_scale: float,
             q_data_type: torch.dtype, kv_data_type: torch.dtype) -> None:
        qo, ind, idx, lens = (metadata.qo_indptr, metadata.kv_indptr, metadata.kv_indices,
                              metadata.kv_len_arr)
        for name, t in (("qo_indptr", qo), ("kv_indptr", ind), ("kv_indices", idx),
                        ("kv_len_arr", lens)):
            _check(t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}")
            _check(t.dim() == 1, f"{name} must be 1-D")
        batch = lens.numel()
        _check(batch >= 1 and qo.numel() == batch + 1 and ind.numel() == batch + 1,
               "qo_indptr / kv_indptr must be [batch + 1] for kv_len_arr [batch]")
        _check(int(qo[0]) == 0 and int(ind[0]) == 0, "indptr arrays must start at 0")
        _check(idx.numel() == int(ind[-1]), "kv_indices must hold kv_indptr[-1] pages")
        pages = (ind[1:] - ind[:-1]).tolist()
        for p, n in zip(pages, lens.tolist(), strict=True):
            _check(0 < n <= p * page_size and n > (p - 1) * page_size,
                   f"kv_len {n} does not fill {p} pages of {page_size}")
        _check(_mla_dims_ok(head_dim_ckv, head_dim_kpe),
               f"head_dim_ckv={head_dim_ckv}, head_dim_kpe={head_dim_kpe}: no FA MLA kernel")
        _check(q_data_type in (torch.float16, torch.bfloat16), "MLA q dtype must be fp16/bf16")
        _check(kv_data_type == q_data_type, "non-FP8 KV dtype must match the query dtype")
        plan = dict(qo=qo.cpu().long(), ind=ind.cpu().long(), idx=idx.long(),
                    lens=lens.cpu().long(), heads=num_heads, ckv=head_dim_ckv,
                    kpe=head_dim_kpe, page=page_size, causal=causal, scale=sm_scale,
                    dtype=q_data_type)
        self.plans.append(plan)
        self._plan = plan

    def run(self, *, query: torch.Tensor, kv_cache: torch.Tensor,
            out: torch.Tensor | None = None) -> torch.Tensor:
        plan = self._plan
        _check(plan is not None, "run() before plan()")
        assert plan is not None
        self.runs.append(dict(query=query, out=out))
        total, h, lat = int(plan["qo"][-1]), plan["heads"], plan["ckv"]
        dim = lat + plan["kpe"]
        _check(query.dim() == 3, "packed query must have rank 3")
        _check(tuple(query.shape) == (total, h, dim),
               f"query must be [{total}, {h}, {dim}] as planned, got {tuple(query.shape)}")
        _check(query.dtype == plan["dtype"], "query dtype differs from the plan")
        _check(kv_cache.dim() == 3 and tuple(kv_cache.shape[1:]) == (plan["page"], dim),
               f"packed kv_cache must be [pages, {plan['page']}, {dim}], "
               f"got {tuple(kv_cache.shape)}")
        _check(kv_cache.dtype == plan["dtype"], "kv_cache dtype differs from the plan")
        if out is not None:
            _check(tuple(out.shape) == (total, h, lat) and out.dtype == query.dtype,
                   f"out must be [{total}, {h}, {lat}] in the query dtype")
        result = torch.zeros(total, h, lat, dtype=torch.float64)
        qo, ind, page = plan["qo"].tolist(), plan["ind"].tolist(), plan["page"]
        for b in range(len(qo) - 1):
            blocks = plan["idx"][ind[b] : ind[b + 1]].cpu()
            sk = int(plan["lens"][b])
            j = torch.arange(sk)
            rows = kv_cache[blocks[j // page], j % page].double()  # [sk, L + R]
            qb = query[qo[b] : qo[b + 1]].double()  # [sq, H, L + R]
            sq = qb.shape[0]
            s = torch.einsum("ihd,jd->hij", qb, rows) * plan["scale"]
            if plan["causal"]:
                visible = (torch.arange(sq)[:, None] + sk - sq) >= j[None, :]
                s = torch.where(visible[None], s, torch.tensor(float("-inf"), dtype=s.dtype))
            result[qo[b] : qo[b + 1]] = torch.einsum(
                "hij,jd->ihd", torch.softmax(s, dim=-1), rows[:, :lat])
        if out is None:
            return result.to(query.dtype)
        out.copy_(result)
        return out


class FakeFlashInfer:
    """Stands in for the ``flashinfer`` module."""

    BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper


class FakeFlashInferMLA:
    """Stands in for ``flashinfer.mla``."""

    BatchMLAPagedAttentionWrapper = BatchMLAPagedAttentionWrapper
    MLAPlanMetadata = MLAPlanMetadata
