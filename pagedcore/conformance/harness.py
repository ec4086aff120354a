"""Run one conformance case: build a paged batch, drive the backend as an engine would, compare.

The backend is used only through its public API (`get_kv_cache_shape`, builder, impl,
`do_kv_cache_update`, `forward`); the cache tensor is never indexed here, so any layout works.
Unused cache memory is poisoned by NaN-filling the whole cache before anything is written, so
every slot that holds no token (tails of referenced blocks, unreferenced blocks, the null
block) is NaN.
"""

from __future__ import annotations

import math
import time
import traceback
from typing import Any

import attrs
import torch

from pagedcore.attention.backend import (
    AttentionBackend,
    AttentionConfig,
    AttentionImpl,
    MetadataBuilder,
)
from pagedcore.attention.cascade import common_prefix_len
from pagedcore.attention.kv_quant import kv_cache_torch_dtype
from pagedcore.attention.metadata import CommonAttentionMetadata, decode_first_order
from pagedcore.conformance.cases import BATCHES, BatchSpec, CaseSpec
from pagedcore.conformance.report import CaseResult
from pagedcore.kv_cache.spec import FullAttentionSpec, SlidingWindowSpec

__all__ = [
    "FP8_SCALES",
    "Batch",
    "alibi_slopes",
    "check_configuration",
    "compare",
    "describe_error",
    "make_batch",
    "make_builder",
    "make_impl",
    "reference_output",
    "run_backend",
    "run_case",
    "run_steps",
    "sink_logits",
    "softmax_scale",
    "step_batches",
    "write_history",
]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: Element offsets the large-offset case must exceed (every referenced block lies above).
OFFSET_LIMIT = 2**31
#: Spare blocks beyond those referenced, left NaN.
_SPARE_BLOCKS = 3


def softmax_scale(head_size: int) -> float:
    """The scale every case uses: deliberately not ``head_size ** -0.5``, so that a backend
    which ignores its ``scale`` argument fails."""
    return 1.25 / math.sqrt(head_size)


def alibi_slopes(num_heads: int) -> list[float]:
    """The ALiBi paper's geometric slopes (exact for powers of two, interleaved otherwise)."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = [2.0 ** (-8.0 * (i + 1) / closest) for i in range(closest)]
    extra = [2.0 ** (-4.0 * (2 * i + 1) / closest) for i in range(num_heads - closest)]
    return base + extra


#: ``(k_scale, v_scale)`` of every fp8 case: about ``max|x| / 448`` for the suite's N(0, 1)
#: inputs (so e4m3 uses its range and the largest values saturate), and different from each
#: other and from 1, so that a backend which ignores one, or swaps them, fails.
FP8_SCALES = (0.0123, 0.0171)


def sink_logits(num_heads: int) -> list[float]:
    """The sink logit of each query head in sink cases: spread over ``[-1, 3)`` (golden-ratio
    steps), so some heads' sinks dominate short contexts and others barely matter."""
    return [-1.0 + 4.0 * ((h * 0.6180339887) % 1.0) for h in range(num_heads)]


@attrs.frozen(kw_only=True)
class Batch:
    """One step's inputs, unpaged (float32) and paged (block table, slots).

    Attributes
    ----------
    contexts, query_lens:
        Per request, in batch (decode-first) order.
    keys, values:
        Per request ``[seq_len, Hkv, D]`` float32, already rounded to the model dtype.
    queries:
        Per request ``[query_len, Hq, D]`` float32, already rounded to the model dtype.
    block_ids:
        Per request, the physical block of each logical block.
    num_blocks:
        Blocks in the cache (block 0 is the null block and is never referenced).
    """

    contexts: list[int]
    query_lens: list[int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    queries: list[torch.Tensor]
    block_ids: list[list[int]]
    num_blocks: int
    block_size: int
    pad: int

    @property
    def seq_lens(self) -> list[int]:
        return [c + q for c, q in zip(self.contexts, self.query_lens, strict=True)]

    def slots(self, req: int, start: int, stop: int) -> list[int]:
        bsz = self.block_size
        return [self.block_ids[req][p // bsz] * bsz + p % bsz for p in range(start, stop)]


def _assign_blocks(
    gen: torch.Generator, counts: list[int], full: list[list[bool]], num_blocks: int, low: int
) -> list[list[int]]:
    """Random distinct physical ids from ``[low, num_blocks)``; the last block of the cache
    goes to a full logical block when there is one, so that a write through a ``-1`` slot
    (which Python indexing sends to the very last slot) corrupts real data."""
    total = sum(counts)
    pool = torch.randperm(num_blocks - low, generator=gen)[:total] + low
    ids = pool.tolist()
    last = num_blocks - 1
    flat_full = [f for fs in full for f in fs]
    if last not in ids and any(flat_full):
        ids[flat_full.index(True)] = last
    elif last in ids and any(flat_full):
        j, k = ids.index(last), flat_full.index(True)
        ids[j], ids[k] = ids[k], ids[j]
    out, it = [], iter(ids)
    for n in counts:
        out.append([next(it) for _ in range(n)])
    return out


def make_batch(
    case: CaseSpec,
    reorder_threshold: int,
    *,
    spec: BatchSpec | None = None,
    num_blocks: int | None = None,
    seed: int | None = None,
) -> Batch:
    """The case's requests with random data and randomly permuted physical blocks.

    `spec` replaces the case's named batch (``BATCHES[case.batch]``), `num_blocks` the
    cache's block count (at least one past the blocks the batch uses; a cache shared by
    several steps), `seed` the case's seed (a different step of the same case).
    """
    gen = torch.Generator().manual_seed(case.seed if seed is None else seed)
    spec = BATCHES[case.batch] if spec is None else spec
    reqs = list(spec.scaled(case.block_size))
    order = decode_first_order([q for _, q in reqs], reorder_threshold)
    reqs = [reqs[i] for i in order]
    bsz = case.block_size
    counts = [-(-(c + q) // bsz) for c, q in reqs]
    full = [[(j + 1) * bsz <= c + q for j in range(n)] for (c, q), n in zip(reqs, counts,
                                                                            strict=True)]
    used = sum(counts)
    if case.large_offsets:
        per_block = bsz * case.num_kv_heads * case.head_size
        low = -(-OFFSET_LIMIT // per_block)
        num_blocks = low + used + _SPARE_BLOCKS
    elif num_blocks is None:
        low, num_blocks = 1, 1 + used + _SPARE_BLOCKS
    elif num_blocks < 1 + used:
        raise ValueError(f"num_blocks={num_blocks}: the batch needs {used} blocks past the null "
                         "block")
    else:
        low = 1
    shared = spec.scaled_shared_prefix(bsz)
    shared_blocks = shared // bsz
    if shared_blocks:
        # Requests after the first reuse its first blocks: fewer distinct blocks, same layout.
        counts_own = [counts[0]] + [n - shared_blocks for n in counts[1:]]
        full_own = [full[0]] + [f[shared_blocks:] for f in full[1:]]
        own = _assign_blocks(gen, counts_own, full_own, num_blocks, low)
        block_ids = [own[0]] + [own[0][:shared_blocks] + ids for ids in own[1:]]
    else:
        block_ids = _assign_blocks(gen, counts, full, num_blocks, low)
    dtype = _DTYPES[case.dtype]

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype).to(torch.float32)

    hkv, hq, d = case.num_kv_heads, case.num_heads, case.head_size
    keys = [rnd(c + q, hkv, d) for c, q in reqs]
    values = [rnd(c + q, hkv, d) for c, q in reqs]
    queries = [rnd(q, hq, d) for _, q in reqs]
    for k, v in zip(keys[1:], values[1:], strict=True):
        k[:shared], v[:shared] = keys[0][:shared], values[0][:shared]
    if spec.needles:
        _plant_needles(spec.needles, [c for c, _ in reqs], keys, queries, gen, dtype)
    return Batch(
        contexts=[c for c, _ in reqs],
        query_lens=[q for _, q in reqs],
        keys=keys,
        values=values,
        queries=queries,
        block_ids=block_ids,
        num_blocks=num_blocks,
        block_size=bsz,
        pad=spec.pad,
    )


#: How far (natural-log units, after the softmax scale) a needle key's score stands above a
#: typical key's.
NEEDLE_LIFT = 5.0


def _plant_needles(needles: tuple[int, ...], contexts: list[int], keys: list[torch.Tensor],
                   queries: list[torch.Tensor], gen: torch.Generator,
                   dtype: torch.dtype) -> None:
    """Make the `needles` positions of every context needles, in place: per KV head a random
    unit vector ``u``; a needle's key becomes ``sqrt(D) * u`` and every query of the heads
    that read that KV head gets ``NEEDLE_LIFT / 1.25 * u`` added, so that with the suite's
    scale (`softmax_scale`) each needle scores ``NEEDLE_LIFT`` plus noise above a typical
    key. Values stay random and distinct: the output depends on each needle by itself, and a
    read of the wrong row for one needle moves it by 5 % or more (a flat random context of
    2,000 keys can hide such a read under the 16-bit tolerances; docs/conformance.md)."""
    hkv, d = keys[0].shape[1], keys[0].shape[2]
    hq = queries[0].shape[1]
    u = torch.randn(hkv, d, generator=gen)
    u = u / u.norm(dim=-1, keepdim=True)
    per_head = u.repeat_interleave(hq // hkv, dim=0)  # query head h reads KV head h // group
    lift = NEEDLE_LIFT / (softmax_scale(d) * math.sqrt(d))
    needle_key = (math.sqrt(d) * u).to(dtype).to(torch.float32)
    for context, k, q in zip(contexts, keys, queries, strict=True):
        for pos in needles:
            if -context <= pos < context:
                k[pos % context] = needle_key
        q.copy_((q + lift * per_head).to(dtype).to(torch.float32))


def _common(batch: Batch, block_ids: list[list[int]], device: torch.device,
            slot_mapping: list[int]) -> CommonAttentionMetadata:
    qsl = [0]
    for q in batch.query_lens:
        qsl.append(qsl[-1] + q)
    seq = batch.seq_lens
    width = max(len(b) for b in block_ids) + 1  # a spare null column, as an engine leaves it
    table = torch.zeros(len(seq), width, dtype=torch.int32)
    for r, ids in enumerate(block_ids):
        table[r, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    positions = [p for c, s in zip(batch.contexts, seq, strict=True) for p in range(c, s)]
    qsl_cpu = torch.tensor(qsl, dtype=torch.int32)
    seq_cpu = torch.tensor(seq, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl_cpu.to(device),
        query_start_loc_cpu=qsl_cpu,
        seq_lens=seq_cpu.to(device),
        seq_lens_cpu=seq_cpu,
        num_reqs=len(seq),
        num_actual_tokens=qsl[-1],
        max_query_len=max(batch.query_lens),
        max_seq_len=max(seq),
        block_table=table.to(device),
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
        positions=torch.tensor(positions + [0] * batch.pad, dtype=torch.int64, device=device),
        causal=True,
    )


def make_impl(backend: type[AttentionBackend], case: CaseSpec) -> AttentionImpl[Any]:
    """`backend`'s impl for the case's layer: its heads, the suite's scale (`softmax_scale`),
    and the features the case switches on (ALiBi slopes, window, soft-cap, sinks, and an fp8
    cache with `FP8_SCALES` or the case's own, given to the constructor or, with
    ``late_scales``, through `AttentionImpl.set_kv_scales` afterwards)."""
    hq = case.num_heads
    extra: dict[str, Any] = {}
    scales = FP8_SCALES if case.fp8_scales is None else case.fp8_scales
    if case.kv_cache_dtype != "auto" and not case.late_scales:
        extra = {"k_scale": scales[0], "v_scale": scales[1]}
    if case.sinks:
        extra["sinks"] = sink_logits(hq)
    impl = backend.get_impl_cls()(
        hq,
        case.head_size,
        softmax_scale(case.head_size),
        num_kv_heads=case.num_kv_heads,
        alibi_slopes=alibi_slopes(hq) if case.alibi else None,
        sliding_window=case.sliding_window,
        logits_soft_cap=case.logits_soft_cap,
        kv_cache_dtype=case.kv_cache_dtype,
        **extra,
    )
    if case.kv_cache_dtype != "auto" and case.late_scales:
        impl.set_kv_scales(*scales)  # built with 1.0, set before the first write
    return impl


def make_builder(
    backend: type[AttentionBackend], case: CaseSpec, device: torch.device
) -> MetadataBuilder[Any]:
    """`backend`'s metadata builder for the case's layer (a full-attention spec, or a
    sliding-window one when the case has a window)."""
    spec_cls: Any = FullAttentionSpec
    extra: dict[str, Any] = {}
    if case.sliding_window is not None:
        spec_cls, extra = SlidingWindowSpec, {"sliding_window": case.sliding_window}
    spec = spec_cls(block_size=case.block_size, num_kv_heads=case.num_kv_heads,
                    head_size=case.head_size, dtype=case.dtype, **extra)
    return backend.get_builder_cls()(spec, ["conformance.layer"], device)


def describe_error(exc: BaseException) -> str:
    """``"Type: message (file.py:line)"``, naming the innermost frame outside torch and
    triton: the backend line that went wrong."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "/torch/" not in f.filename and "/triton/" not in f.filename]
    where = ""
    if frames:
        frame = (ours or frames)[-1]
        where = f" ({frame.filename.rsplit('/', 1)[-1]}:{frame.lineno})"
    return f"{type(exc).__name__}: {exc}{where}"


def write_history(
    impl: AttentionImpl[Any],
    batch: Batch,
    kv_cache: torch.Tensor,
    *,
    device: torch.device,
    dtype: torch.dtype,
) -> None:
    """Write every request's context K/V (positions ``[0, context)``, in `dtype`) into
    `kv_cache` through `impl`'s own cache write, at the slots of `batch`'s block ids: what
    earlier steps would have left there."""
    hist = [(r, c) for r, c in enumerate(batch.contexts) if c > 0]
    if hist:
        impl.do_kv_cache_update(
            torch.cat([batch.keys[r][:c] for r, c in hist]).to(device, dtype),
            torch.cat([batch.values[r][:c] for r, c in hist]).to(device, dtype),
            kv_cache,
            torch.tensor([s for r, c in hist for s in batch.slots(r, 0, c)], device=device),
        )


def reference_output(case: CaseSpec, batch: Batch, device: torch.device) -> torch.Tensor:
    """The reference backend's ``[T_real, Hq, D]`` float32 output for `batch`: the same
    rounded inputs, in float32, in a compact cache of its own."""
    from pagedcore.reference import ReferenceBackend

    compact, n = [], 1
    for ids in batch.block_ids:
        compact.append(list(range(n, n + len(ids))))
        n += len(ids)
    ref_case = attrs.evolve(case, dtype="float32")
    return run_backend(
        ReferenceBackend, ref_case, batch, device=device, dtype=torch.float32,
        block_ids=compact, num_blocks=n,
    )[0][: sum(batch.query_lens)]


def run_backend(
    backend: type[AttentionBackend],
    case: CaseSpec,
    batch: Batch,
    *,
    device: torch.device,
    dtype: torch.dtype,
    block_ids: list[list[int]],
    num_blocks: int,
    use_output_buffer: bool = False,
    repeat_forward: bool = False,
) -> list[torch.Tensor]:
    """Drive `backend` through one step exactly as an engine would; return its ``[T, Hq, D]``
    output (twice, from two `forward` calls on the same metadata, when `repeat_forward`: an
    engine reuses one plan for every layer)."""
    impl = make_impl(backend, case)
    shape = backend.get_kv_cache_shape(num_blocks, case.block_size, case.num_kv_heads,
                                       case.head_size, case.kv_cache_dtype)
    cache_dtype = kv_cache_torch_dtype(case.kv_cache_dtype, dtype)
    kv_cache = torch.full(shape, float("nan"), dtype=cache_dtype, device=device)
    paged = attrs.evolve(batch, block_ids=block_ids, num_blocks=num_blocks)
    write_history(impl, paged, kv_cache, device=device, dtype=dtype)
    builder = make_builder(backend, case, device)
    return _step(backend, case, paged, impl, builder, kv_cache, device=device, dtype=dtype,
                 use_output_buffer=use_output_buffer, repeat_forward=repeat_forward)


def _step(
    backend: type[AttentionBackend],
    case: CaseSpec,
    paged: Batch,
    impl: AttentionImpl[Any],
    builder: MetadataBuilder[Any],
    kv_cache: torch.Tensor,
    *,
    device: torch.device,
    dtype: torch.dtype,
    use_output_buffer: bool,
    repeat_forward: bool,
) -> list[torch.Tensor]:
    """One step of `paged` (its history already in `kv_cache`): write its new K/V through
    `impl`, build the plan with `builder`, run `forward` (twice with `repeat_forward`)."""
    batch, block_ids = paged, paged.block_ids
    hq, hkv, d, bsz = case.num_heads, case.num_kv_heads, case.head_size, case.block_size
    seq = batch.seq_lens
    slot_mapping = [s for r, c in enumerate(batch.contexts) for s in paged.slots(r, c, seq[r])]
    slot_mapping += [-1] * batch.pad
    nan_kv = torch.full((batch.pad, hkv, d), float("nan"))
    key = torch.cat([*(k[c:] for k, c in zip(batch.keys, batch.contexts, strict=True)), nan_kv])
    value = torch.cat(
        [*(v[c:] for v, c in zip(batch.values, batch.contexts, strict=True)), nan_kv]
    )
    query = torch.cat([*batch.queries, torch.full((batch.pad, hq, d), float("nan"))])
    key, value, query = (t.to(device, dtype) for t in (key, value, query))
    common = _common(paged, block_ids, device, slot_mapping)
    impl.do_kv_cache_update(key, value, kv_cache, common.slot_mapping)

    # Cascade as the engine requests it: shared full blocks, never with a window.
    prefix = 0
    if backend.supports_cascade and case.sliding_window is None:
        prefix = common_prefix_len(block_ids, batch.contexts, bsz)
    metadata = builder.build(common, common_prefix_len=prefix)
    outputs = []
    for _ in range(2 if repeat_forward else 1):
        if use_output_buffer:
            out = torch.full_like(query, float("nan"))
            impl.forward(query, key, value, kv_cache, metadata, output=out)
        else:
            out = impl.forward(query, key, value, kv_cache, metadata)
        if tuple(out.shape) != tuple(query.shape) or out.dtype != dtype:
            raise AssertionError(
                f"forward returned {tuple(out.shape)} {out.dtype}, expected "
                f"{tuple(query.shape)} {dtype}"
            )
        outputs.append(out)
    return outputs


def step_batches(full: Batch, steps: int) -> list[Batch]:
    """The batches of a `steps`-step case: step 0 is `full` less its last ``steps - 1``
    query tokens per request, and each later step decodes one more token of every request
    (its context all that came before; the same blocks)."""
    out = []
    for step in range(steps):
        contexts, query_lens, queries = [], [], []
        for c, q, qs in zip(full.contexts, full.query_lens, full.queries, strict=True):
            first = q - (steps - 1)
            start = 0 if step == 0 else first + step - 1
            length = first if step == 0 else 1
            contexts.append(c + start)
            query_lens.append(length)
            queries.append(qs[start : start + length])
        seq = [c + q for c, q in zip(contexts, query_lens, strict=True)]
        out.append(attrs.evolve(
            full, contexts=contexts, query_lens=query_lens, queries=queries,
            keys=[k[:n] for k, n in zip(full.keys, seq, strict=True)],
            values=[v[:n] for v, n in zip(full.values, seq, strict=True)]))
    return out


def run_steps(
    backend: type[AttentionBackend], case: CaseSpec, *, device: torch.device,
    threshold: int,
) -> tuple[list[CaseResult], Batch]:
    """Run a ``case.steps``-step case on one impl, one builder and one cache; each step's
    result against the reference (and the last step's batch)."""
    spec = BATCHES[case.batch]
    # Decode-first by the first step's query lengths (later steps are all decodes), then
    # each request longer by the later steps' tokens (threshold 0: no reordering).
    order = decode_first_order([q for _, q in spec.requests], threshold)
    longer = attrs.evolve(spec, requests=tuple(
        (spec.requests[i][0], spec.requests[i][1] + case.steps - 1) for i in order))
    full = make_batch(case, 0, spec=longer)
    dtype = _DTYPES[case.dtype]
    impl = make_impl(backend, case)
    shape = backend.get_kv_cache_shape(full.num_blocks, case.block_size, case.num_kv_heads,
                                       case.head_size, case.kv_cache_dtype)
    kv_cache = torch.full(shape, float("nan"),
                          dtype=kv_cache_torch_dtype(case.kv_cache_dtype, dtype), device=device)
    builder = make_builder(backend, case, device)
    batches = step_batches(full, case.steps)
    write_history(impl, batches[0], kv_cache, device=device, dtype=dtype)
    results = []
    for batch in batches:
        outs = _step(backend, case, batch, impl, builder, kv_cache, device=device, dtype=dtype,
                     use_output_buffer=case.use_output_buffer, repeat_forward=False)
        results.append(compare(outs[0], reference_output(case, batch, device), batch,
                               case.tolerance))
    return results, batches[-1]


def _locate(batch: Batch, row: int) -> str:
    start = 0
    for r, q in enumerate(batch.query_lens):
        if row < start + q:
            return (f"request {r} (context {batch.contexts[r]}, query {q}), "
                    f"query token {row - start}")
        start += q
    return f"row {row}"


def compare(out: torch.Tensor, ref: torch.Tensor, batch: Batch, tol: float) -> CaseResult:
    """Check real rows of `out` against `ref` (``[T_real, Hq, D]``)."""
    got = out[: ref.shape[0]].to(torch.float32).cpu()
    ref = ref.cpu()
    nan_rows = torch.isnan(got).flatten(1).any(dim=1).nonzero().flatten().tolist()
    if nan_rows:
        return CaseResult(
            name="", passed=False, tolerance=tol,
            message=f"NaN in {len(nan_rows)} real output row(s), first at "
                    f"{_locate(batch, nan_rows[0])}",
        )
    diff = (got - ref).abs()
    err = float(diff.max()) / max(float(ref.abs().max()), 1e-6)
    if err <= tol:
        return CaseResult(name="", passed=True, max_rel_error=err, tolerance=tol)
    row, head = divmod(int(diff.amax(dim=2).argmax()), ref.shape[1])
    return CaseResult(
        name="", passed=False, max_rel_error=err, tolerance=tol,
        message=f"error {err:.2e} > {tol:.0e}; worst at {_locate(batch, row)}, head {head}",
    )


def _memory_shortfall(
    backend: type[AttentionBackend], case: CaseSpec, batch: Batch, device: torch.device
) -> str | None:
    """Why the (multi-GB) large-offset cache cannot be allocated here, or None."""
    if not case.large_offsets or device.type != "cuda":
        return None
    shape = backend.get_kv_cache_shape(
        batch.num_blocks, case.block_size, case.num_kv_heads, case.head_size,
        case.kv_cache_dtype,
    )
    need = math.prod(shape) * kv_cache_torch_dtype(case.kv_cache_dtype,
                                                   _DTYPES[case.dtype]).itemsize
    free, _total = torch.cuda.mem_get_info(device)
    if need > 0.9 * free:
        return f"the int32-overflow cache needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} free"
    return None


def check_configuration(
    backend: type[AttentionBackend], case: CaseSpec, *, device: str
) -> CaseResult | None:
    """None when `backend` accepts the case's configuration; else the case's result: a
    failure (the backend declared every feature of it), or a skip for an `optional`
    combination."""
    cfg = AttentionConfig(
        head_size=case.head_size, dtype=case.dtype, block_size=case.block_size,
        sliding_window=case.sliding_window, use_alibi=case.alibi,
        logits_soft_cap=case.logits_soft_cap, device=device,
        kv_cache_dtype=case.kv_cache_dtype, has_sink=case.sinks,
    )
    reasons = backend.validate_configuration(cfg)
    if not isinstance(reasons, (list, tuple)) or not all(isinstance(r, str) for r in reasons):
        return CaseResult(
            name=case.name, passed=False,
            message=f"validate_configuration() must return a list of str (empty: it serves "
                    f"the configuration), got {type(reasons).__name__} {reasons!r:.60}")
    if not reasons:
        return None
    why = "; ".join(reasons)
    if case.optional:
        return CaseResult.skip(case.name, f"combination rejected: {why}")
    return CaseResult(
        name=case.name, passed=False,
        message=f"declared support, but validate_configuration rejects it: {why}",
    )


def run_case(backend: type[AttentionBackend], case: CaseSpec, *, device: str) -> CaseResult:
    """Run one case of `backend` on `device` against the float32 reference."""
    if case.skip is not None:
        return CaseResult.skip(case.name, case.skip)
    start = time.perf_counter()
    rejected = check_configuration(backend, case, device=device)
    if rejected is not None:
        return rejected
    dev = torch.device(device)
    try:
        threshold = backend.get_builder_cls().reorder_batch_threshold
        if case.steps > 1:
            results, _ = run_steps(backend, case, device=dev, threshold=threshold)
            failed = next(((i, r) for i, r in enumerate(results) if not r.passed), None)
            result = results[-1] if failed is None else attrs.evolve(
                failed[1], message=f"step {failed[0] + 1} of {case.steps} on one impl, builder "
                                   f"and cache: {failed[1].message}")
            return attrs.evolve(result, name=case.name, seconds=time.perf_counter() - start)
        batch = make_batch(case, threshold)
        short = _memory_shortfall(backend, case, batch, dev)
        if short is not None:
            return CaseResult.skip(case.name, short)
        outs = run_backend(
            backend, case, batch, device=dev, dtype=_DTYPES[case.dtype],
            block_ids=batch.block_ids, num_blocks=batch.num_blocks,
            use_output_buffer=case.use_output_buffer, repeat_forward=case.repeat_forward,
        )
        ref = reference_output(case, batch, dev)
        results = [compare(out, ref, batch, case.tolerance) for out in outs]
        result = next((r for r in results if not r.passed), results[-1])
        if len(results) > 1 and not result.passed and results[0].passed:
            result = attrs.evolve(
                result, message=f"second forward() on the same metadata: {result.message}"
            )
    except Exception as exc:  # a crash is a failure of the case, reported with its origin
        result = CaseResult(name=case.name, passed=False, message=describe_error(exc))
    return attrs.evolve(result, name=case.name, seconds=time.perf_counter() - start)
