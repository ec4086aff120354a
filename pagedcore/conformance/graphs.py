"""Graph-plan cases: a decode plan made once for CUDA graphs stays right on every replay.

An engine serving decode steps from CUDA graphs (`pagedcore.engine.runner.cuda_graph`,
`pagedcore.engine.runner.cascade_graphs`) plans each batch-size bucket *once*, on persistent
buffers, and before every replay rewrites those buffers in place and calls
`MetadataBuilder.prepare_replay`. These cases drive a backend through that sequence and compare
each step with the reference; they run only for what a backend declares:

* ``graph/decode/...`` (``cudagraph_support >= UNIFORM_SINGLE_TOKEN_DECODE``): the plan of
  `MetadataBuilder.build_for_cudagraph_capture`;
* ``graph/cascade/...`` (``supports_cascade_cudagraph``): the plan of
  `MetadataBuilder.build_cascade_for_cudagraph_capture`, whose ``[1]`` int32 ``prefix_len``
  is rewritten (``fill_``) before each replay, 0 included;
* ``graph/cascade_mixed/...`` (``supports_cascade_mixed_cudagraph``): the same method on a
  mixed token bucket (`MIXED_TOKENS` token slots over `BUCKET` request slots): decodes and
  prompt chunks that share a prefix, each query after it.

One case is one plan, one KV cache and one set of buffers for a bucket of `BUCKET` requests,
through the steps of `graph_steps`: the capture step (the plan's first contents; its forward
is the engine's warm-up), then replays with longer contexts crossing block boundaries up to
the capacity, other physical blocks, another number of real requests (the rest of the bucket
padding: ``seq_lens`` 1, a null-block row, slot -1) and, for cascade, other shared prefixes.
Per step, as the engine does: the buffers are rewritten in place (the plan's ``common`` is
the same object every time, ``max_seq_len`` = the capacity), ``prefix_len`` is filled, then
`prepare_replay` (not before the capture step's forward), the step's K/V written by
`AttentionImpl.do_kv_cache_update` through the persistent ``slot_mapping``, and
`AttentionImpl.forward` on the plan. The cache is refilled with NaN before each step, so every
slot no request owns (block tails, the null block, the padding rows' reads) holds NaN, and the
padding rows' query and K/V are NaN.

A captured graph replays kernels, not Python: whatever its cache write and forward read on the
host was frozen at capture. So during a replay's cache write and forward the host copies
(``seq_lens_cpu``, ``query_start_loc_cpu``) hold the capture step's values;
`prepare_replay` sees the replay's own. No graph is captured (the forward runs eagerly on any
device): what is checked is the plan's contract, not capture itself.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import attrs
import torch

from pagedcore.attention.backend import AttentionBackend, CudaGraphSupport
from pagedcore.attention.kv_quant import kv_cache_torch_dtype
from pagedcore.attention.metadata import CommonAttentionMetadata
from pagedcore.conformance.cases import (
    BatchSpec,
    CaseSpec,
    _base_dtype,
    _block_sizes,
    _head_sizes,
    _prefer,
    _suffix,
)
from pagedcore.conformance.harness import (
    _DTYPES,
    _SPARE_BLOCKS,
    Batch,
    check_configuration,
    compare,
    describe_error,
    make_batch,
    make_builder,
    make_impl,
    reference_output,
    write_history,
)
from pagedcore.conformance.report import CaseResult

__all__ = [
    "BUCKET",
    "MIXED_TOKENS",
    "GraphCase",
    "GraphStep",
    "build_graph_cases",
    "graph_capacity",
    "graph_steps",
    "run_graph_case",
]

#: Requests in the captured bucket (real ones first, then padding).
BUCKET = 4
#: Token slots of the mixed bucket (``graph/cascade_mixed``; real tokens first).
MIXED_TOKENS = 16
#: The block table's capacity in tokens at block size 16 (stretched for larger blocks).
CAPACITY_TOKENS = 96
#: Head sizes the cases prefer, smallest first (CPU and interpreter friendly).
_HEAD_SIZES = (32, 16, 64, 80, 96, 128)
#: Sliding window of the full suite's windowed decode case (contexts reach the capacity).
_WINDOW = 19

_NAN = float("nan")
#: The builder method that plans each kind of case.
_CAPTURE_METHODS = {"decode": "build_for_cudagraph_capture",
                    "cascade": "build_cascade_for_cudagraph_capture",
                    "cascade_mixed": "build_cascade_for_cudagraph_capture"}
#: The kinds whose plan gets ``(prefix_len, capacity)``.
_CASCADE_KINDS = ("cascade", "cascade_mixed")


@attrs.frozen(kw_only=True)
class GraphStep:
    """The contents of one step of the bucket.

    Attributes
    ----------
    contexts:
        Per real request (the first ``len(contexts)`` rows of the bucket), the tokens already
        in the cache; its query tokens start at position ``context``. The other rows are
        padding.
    prefix_len:
        Cascade: tokens ``P`` the real requests share in the same physical blocks (a multiple
        of the block size, at most every context), written into the plan's ``prefix_len``;
        0 shares nothing.
    query_lens:
        Mixed buckets: query tokens per real request (decodes first); empty: one each.
    """

    contexts: tuple[int, ...]
    prefix_len: int = 0
    query_lens: tuple[int, ...] = ()

    @property
    def queries(self) -> tuple[int, ...]:
        """Query tokens per real request."""
        return self.query_lens or (1,) * len(self.contexts)


@attrs.frozen(kw_only=True)
class GraphCase:
    """One graph-plan case.

    Attributes
    ----------
    kind:
        ``"decode"`` (`MetadataBuilder.build_for_cudagraph_capture`), ``"cascade"`` or
        ``"cascade_mixed"`` (`MetadataBuilder.build_cascade_for_cudagraph_capture` on a
        decode or a mixed bucket).
    layer:
        The layer: shapes, dtype, features, seed and tolerance, as a `CaseSpec` named like
        this case (its ``batch`` is unused: the steps are `graph_steps`).
    """

    kind: str
    layer: CaseSpec

    @property
    def name(self) -> str:
        """``graph/KIND/dtype/hsD/bsB/hQkvK[/features]``."""
        return self.layer.name


def graph_capacity(block_size: int) -> int:
    """Tokens one block-table row holds in these cases (its width ``W`` times `block_size`):
    `CAPACITY_TOKENS` at block size 16, stretched like the suite's contexts for larger
    blocks. It is also the plan's ``max_seq_len`` and the cascade capacity."""
    factor = max(1, block_size // 16)
    return -(-CAPACITY_TOKENS * factor // block_size) * block_size


def graph_steps(kind: str, block_size: int) -> tuple[GraphStep, ...]:
    """The capture step, then the replays, of a `kind` case at `block_size`.

    Decode: 2 short requests (+ 2 padding) at capture; then all 4 rows real, crossing block
    boundaries (one a token past a block); then 3 real, one at the capacity and one ending
    on a block edge. Cascade: the same capture (``P`` = 0, as the engine captures); then 4
    requests sharing 2 blocks (one whose context is exactly the prefix); then ``P`` = 0 on
    unshared requests (the plain plan); then a prefix of about two thirds of the capacity.
    Mixed cascade: the cascade steps with prompt chunks beside the decodes (up to
    `MIXED_TOKENS` tokens; one request's chunk starting exactly at the prefix), the last
    with padding tokens after the real ones.
    """
    f = max(1, block_size // 16)
    cap = graph_capacity(block_size)
    capture = GraphStep(contexts=(3 * f, 9 * f))
    if kind == "decode":
        return (
            capture,
            GraphStep(contexts=(40 * f, 16 * f, 71 * f, 25 * f)),
            GraphStep(contexts=(cap - 1, 31 * f, 57 * f)),
        )
    if kind not in _CASCADE_KINDS:
        raise ValueError(f"graph case kind {kind!r} is not one of 'decode', "
                         "'cascade', 'cascade_mixed'")
    short = 2 * block_size
    long = max(2 * cap // 3 // block_size, 3) * block_size
    if kind == "cascade_mixed":
        return (
            GraphStep(contexts=(3 * f, 9 * f), query_lens=(1, 5)),
            GraphStep(contexts=(short + 8 * f, short + 39 * f, short, short + 18 * f),
                      prefix_len=short, query_lens=(1, 1, 5, 9)),
            GraphStep(contexts=(cap - 17, 31 * f, 57 * f), query_lens=(1, 6, 9)),
            GraphStep(contexts=(cap - 1, long, min(long + 5 * f, cap - 8)), prefix_len=long,
                      query_lens=(1, 2, 7)),
        )
    return (
        capture,
        GraphStep(contexts=(short + 8 * f, short, short + 39 * f, short + 18 * f),
                  prefix_len=short),
        GraphStep(contexts=(cap - 1, 31 * f, 57 * f)),
        GraphStep(contexts=(cap - 1, long, min(long + 5 * f, cap - 1)), prefix_len=long),
    )


def build_graph_cases(
    backend: type[AttentionBackend], *, quick: bool = False, device: str = "cpu"
) -> list[GraphCase]:
    """The graph-plan cases `backend`'s declarations call for (none without a capability).

    One decode and one cascade case (each where declared) in the suite's base dtype, a small
    head size (32 where any is allowed, else the first declared of 16, 64, 80, 96, 128),
    block size 16 or the nearest declared, 8 query heads on 2 KV heads. The full list adds
    every other dtype, another block size and each declared feature (a sliding window for
    decode only: the engine never cascades windowed layers).
    """
    kinds = []
    if backend.cudagraph_support >= CudaGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE:
        kinds.append("decode")
    if backend.supports_cascade_cudagraph:
        kinds.append("cascade")
    if (getattr(backend, "supports_cascade_mixed_cudagraph", False)
            and backend.cudagraph_support >= CudaGraphSupport.ALWAYS):
        kinds.append("cascade_mixed")
    if backend.mla_only or not kinds:
        return []
    base_dtype = _base_dtype(backend, device)
    block_sizes = _block_sizes(backend)
    base: dict[str, Any] = {
        "dtype": base_dtype,
        "head_size": _prefer(_head_sizes(backend), _HEAD_SIZES),
        "block_size": _prefer(block_sizes, (16, 32, 8, 64)),
        "num_heads": 8,
        "num_kv_heads": 2,
    }
    variants: list[dict[str, Any]] = [{}]
    if not quick:
        variants += [{"dtype": d} for d in backend.supported_dtypes if d != base_dtype]
        variants += [{"block_size": b} for b in block_sizes if b != base["block_size"]][:1]
        if backend.supports_sliding_window:
            variants.append({"sliding_window": _WINDOW})
        if backend.supports_alibi:
            variants.append({"alibi": True})
        if backend.supports_logits_soft_cap:
            variants.append({"logits_soft_cap": 2.0})
        if backend.supports_sink:
            variants.append({"sinks": True})
        fp8 = [k for k in backend.supported_kv_cache_dtypes if k != "auto"]
        if fp8:
            variants.append({"kv_cache_dtype": fp8[0]})
    cases = []
    for kind in kinds:
        for v in variants:
            if kind in _CASCADE_KINDS and "sliding_window" in v:
                continue
            spec = {**base, **v}
            name = (f"graph/{kind}/{spec['dtype']}/hs{spec['head_size']}/bs{spec['block_size']}/"
                    f"h{spec['num_heads']}kv{spec['num_kv_heads']}{_suffix(spec)}")
            cases.append(GraphCase(kind=kind, layer=CaseSpec(name=name, batch=f"graph_{kind}",
                                                             **spec)))
    return cases


class _Buffers:
    """The engine's persistent buffers of one bucket, and the metadata over them.

    Attributes
    ----------
    common:
        `CommonAttentionMetadata` over the buffers, the same object at capture and every
        replay. A decode bucket: ``num_reqs`` = ``num_actual_tokens`` = the bucket,
        ``max_query_len`` 1; a mixed bucket (`mixed_tokens` given): ``num_reqs`` = the
        bucket's request slots, ``num_actual_tokens`` = ``max_query_len`` = its token slots.
        ``max_seq_len`` is the capacity.
    query, key, value:
        ``[tokens, Hq, D]`` / ``[tokens, Hkv, D]`` in the model dtype; NaN in padding rows.
    """

    def __init__(self, layer: CaseSpec, *, bucket: int, width: int, dtype: torch.dtype,
                 device: torch.device, mixed_tokens: int | None = None) -> None:
        i32 = torch.int32
        self.mixed = mixed_tokens is not None
        tokens = bucket if mixed_tokens is None else mixed_tokens
        self.qsl_cpu = (torch.zeros(bucket + 1, dtype=i32) if self.mixed
                        else torch.arange(bucket + 1, dtype=i32))
        self.seq_cpu = (torch.zeros if self.mixed else torch.ones)(bucket, dtype=i32)
        # Device buffers of their own, also on the CPU: the host copies change on their own.
        self.common = CommonAttentionMetadata(
            query_start_loc=self.qsl_cpu.to(device, copy=True),
            query_start_loc_cpu=self.qsl_cpu,
            seq_lens=self.seq_cpu.to(device, copy=True),
            seq_lens_cpu=self.seq_cpu,
            num_reqs=bucket,
            num_actual_tokens=tokens,
            max_query_len=tokens if self.mixed else 1,
            max_seq_len=width * layer.block_size,
            block_table=torch.zeros(bucket, width, dtype=i32, device=device),
            slot_mapping=torch.full((tokens,), -1, dtype=torch.int64, device=device),
            positions=torch.zeros(tokens, dtype=torch.int64, device=device),
            causal=True,
        )
        hq, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_size
        self.query = torch.full((tokens, hq, d), _NAN, dtype=dtype, device=device)
        self.key = torch.full((tokens, hkv, d), _NAN, dtype=dtype, device=device)
        self.value = torch.full((tokens, hkv, d), _NAN, dtype=dtype, device=device)

    def write(self, batch: Batch) -> None:
        """Rewrite every buffer in place: `batch`'s requests, then padding. A decode bucket's
        padding rows have query length 1, ``seq_lens`` 1, a null-block row, slot -1 and
        position 0; a mixed
        bucket's padding requests query length 0 and ``seq_lens`` 0 and its padding tokens
        slot -1 and position 0. Padding inputs are NaN."""
        c = self.common
        bucket, width = c.block_table.shape
        tokens = c.slot_mapping.shape[0]
        n = len(batch.contexts)
        real = sum(batch.query_lens)
        if (n > bucket or real > tokens or any(len(ids) > width for ids in batch.block_ids)
                or (not self.mixed and real != n)):
            raise ValueError(f"a step of {n} requests / {real} tokens does not fit the bucket "
                             f"of {bucket} requests x {width} blocks / {tokens} tokens")
        pad_reqs, pad_tokens = bucket - n, tokens - real
        table = torch.zeros(bucket, width, dtype=torch.int32)
        for r, ids in enumerate(batch.block_ids):
            table[r, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        spans = [(ctx, ctx + q) for ctx, q in zip(batch.contexts, batch.query_lens,
                                                  strict=True)]
        slots = [s for r, (a, b) in enumerate(spans) for s in batch.slots(r, a, b)]
        positions = [p for a, b in spans for p in range(a, b)]
        starts = [0]
        for q in batch.query_lens:
            starts.append(starts[-1] + q)
        # A decode bucket's padding rows are one token each (the engine's uniform decode
        # batch); a mixed bucket's padding requests are empty.
        pad_starts = ([real] * pad_reqs if self.mixed
                      else [real + i + 1 for i in range(pad_reqs)])
        self.qsl_cpu.copy_(torch.tensor(starts + pad_starts, dtype=torch.int32))
        self.seq_cpu.copy_(torch.tensor(batch.seq_lens + [0 if self.mixed else 1] * pad_reqs,
                                        dtype=torch.int32))
        c.query_start_loc.copy_(self.qsl_cpu)
        c.seq_lens.copy_(self.seq_cpu)
        c.block_table.copy_(table)
        c.slot_mapping.copy_(torch.tensor(slots + [-1] * pad_tokens, dtype=torch.int64))
        c.positions.copy_(torch.tensor(positions + [0] * pad_tokens, dtype=torch.int64))
        rows = list(zip(batch.keys, batch.values, spans, strict=True))
        for buf, new in ((self.query, list(batch.queries)),
                         (self.key, [k[a:b] for k, _, (a, b) in rows]),
                         (self.value, [v[a:b] for _, v, (a, b) in rows])):
            buf.fill_(_NAN)
            buf[:real] = torch.cat(new).to(buf.device, buf.dtype)

    def host_copies(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the host arrays' current values (``query_start_loc_cpu``,
        ``seq_lens_cpu``)."""
        return self.qsl_cpu.clone(), self.seq_cpu.clone()

    @contextmanager
    def frozen_host(self, values: tuple[torch.Tensor, torch.Tensor]) -> Iterator[None]:
        """Inside the block the host arrays hold `values` (what a graph captured with them
        saw); after it, their own values again."""
        live = self.host_copies()
        self.qsl_cpu.copy_(values[0])
        self.seq_cpu.copy_(values[1])
        try:
            yield
        finally:
            self.qsl_cpu.copy_(live[0])
            self.seq_cpu.copy_(live[1])


def _describe(index: int, step: GraphStep, batch: Batch) -> str:
    """``capture step (...)`` / ``replay N (...)``: the step's requests, lengths and prefix."""
    pad = BUCKET - len(batch.contexts)
    what = f"{len(batch.contexts)} requests" + (f" + {pad} padding" if pad else "")
    what += ", seq_lens " + ", ".join(map(str, batch.seq_lens))
    if step.query_lens:
        what += ", query_lens " + ", ".join(map(str, step.query_lens))
    what += f", prefix_len {step.prefix_len}" if step.prefix_len else ""
    return f"{'capture step' if index == 0 else f'replay {index}'} ({what})"


def _replay_hint(kind: str) -> str:
    what = "the buffers and prefix_len" if kind in _CASCADE_KINDS else "the buffers"
    return (f"; the plan was right for its capture step, not after {what} were rewritten in "
            "place: nothing in it may depend on their values at capture, and whatever it "
            "derives from them must be refreshed in prepare_replay (MetadataBuilder docs)")


def _run(backend: type[AttentionBackend], case: GraphCase, device: torch.device,
         phase: list[str]) -> CaseResult:
    """The case's steps on one plan; `phase` names the step in progress (for an error)."""
    layer = case.layer
    dtype = _DTYPES[layer.dtype]
    capacity = graph_capacity(layer.block_size)
    width = capacity // layer.block_size
    num_blocks = 1 + BUCKET * width + _SPARE_BLOCKS
    impl = make_impl(backend, layer)
    builder = make_builder(backend, layer, device)
    shape = backend.get_kv_cache_shape(num_blocks, layer.block_size, layer.num_kv_heads,
                                       layer.head_size, layer.kv_cache_dtype)
    kv_cache = torch.full(shape, _NAN, dtype=kv_cache_torch_dtype(layer.kv_cache_dtype, dtype),
                          device=device)
    bufs = _Buffers(layer, bucket=BUCKET, width=width, dtype=dtype, device=device,
                    mixed_tokens=MIXED_TOKENS if case.kind == "cascade_mixed" else None)
    prefix_len = torch.zeros(1, dtype=torch.int32, device=device)
    plan: Any = None
    frozen = bufs.host_copies()
    worst = 0.0
    for i, step in enumerate(graph_steps(case.kind, layer.block_size)):
        spec = BatchSpec(f"{case.name}#{i}",
                         tuple(zip(step.contexts, step.queries, strict=True)), 0,
                         "a graph step", stretch=False, shared_prefix=step.prefix_len)
        batch = make_batch(layer, 1, spec=spec, num_blocks=num_blocks, seed=layer.seed + i)
        label = _describe(i, step, batch)
        phase[0] = label
        bufs.write(batch)
        kv_cache.fill_(_NAN)
        write_history(impl, batch, kv_cache, device=device, dtype=dtype)
        if i == 0:
            method = _CAPTURE_METHODS[case.kind]
            phase[0] = f"{label}, {method}"
            plan = getattr(builder, method)(
                bufs.common,
                *((prefix_len, capacity) if case.kind in _CASCADE_KINDS else ()))
            frozen = bufs.host_copies()
        else:
            prefix_len.fill_(step.prefix_len)
            phase[0] = f"{label}, prepare_replay"
            builder.prepare_replay(plan, bufs.common)
        phase[0] = f"{label}, do_kv_cache_update/forward"
        with bufs.frozen_host(frozen):
            impl.do_kv_cache_update(bufs.key, bufs.value, kv_cache, bufs.common.slot_mapping)
            out = impl.forward(bufs.query, bufs.key, bufs.value, kv_cache, plan)
        if tuple(out.shape) != tuple(bufs.query.shape) or out.dtype != dtype:
            raise AssertionError(f"forward returned {tuple(out.shape)} {out.dtype}, expected "
                                 f"{tuple(bufs.query.shape)} {dtype}")
        phase[0] = f"{label}, the reference"
        result = compare(out, reference_output(layer, batch, device), batch, layer.tolerance)
        if not result.passed:
            hint = _replay_hint(case.kind) if i > 0 else ""
            return attrs.evolve(result, message=f"{label}: {result.message}{hint}")
        worst = max(worst, result.max_rel_error or 0.0)
    return CaseResult(name=case.name, passed=True, max_rel_error=worst,
                      tolerance=layer.tolerance)


def run_graph_case(backend: type[AttentionBackend], case: GraphCase, *,
                   device: str) -> CaseResult:
    """Run one graph-plan case of `backend` on `device` against the float32 reference.

    Fails (never raises) when the backend rejects the configuration it declared, when a
    step's real rows miss the tolerance or hold NaN (the message names the step: ``capture
    step`` or ``replay N``, with its lengths and prefix), or when a builder or impl method
    raises (the message names the step and the method).
    """
    start = time.perf_counter()
    rejected = check_configuration(backend, case.layer, device=device)
    if rejected is not None:
        return attrs.evolve(rejected, name=case.name)
    phase = ["setting up"]
    try:
        result = _run(backend, case, torch.device(device), phase)
    except Exception as exc:  # a crash fails the case, with the step it happened in
        result = CaseResult(name=case.name, passed=False,
                            message=f"{phase[0]}: {describe_error(exc)}")
    return attrs.evolve(result, name=case.name, seconds=time.perf_counter() - start)
