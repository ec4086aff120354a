"""Measuring primitives of the kernel benches: timing, copy bandwidth, a paged KV batch.

`PagedKV` holds random K/V of a batch both contiguous and paged with a given block size;
`BackendUnderTest` fills one backend's own cache from it and times its ``forward``. Used by
`pagedcore.bench.kernels`, `pagedcore.bench.backends`, `pagedcore.bench.memory` and
`pagedcore.bench.mla`.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    import torch

    from pagedcore.attention import AttentionBackend, CommonAttentionMetadata

__all__ = [
    "BLOCK_SIZE", "DEFAULT_HEADS", "HEAD_SIZE", "NUM_HEADS", "NUM_KV_HEADS", "BackendUnderTest",
    "HeadShape", "PagedKV", "copy_bandwidth_gbps", "graph_time_ms", "host_ms", "kernel_summary",
    "time_ms",
]

#: Query heads, KV heads and head size of the kernel bench cases by default (Llama-3-8B's).
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 32, 8, 128


@attrs.frozen
class HeadShape:
    """The attention heads a kernel bench case runs: `num_heads` query heads sharing
    `num_kv_heads` KV heads (a whole multiple) of `head_size` each.

    >>> HeadShape(14, 2, 64).group
    7
    """

    num_heads: int = attrs.field(validator=attrs.validators.gt(0))
    num_kv_heads: int = attrs.field(validator=attrs.validators.gt(0))
    head_size: int = attrs.field(validator=attrs.validators.gt(0))

    def __attrs_post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} query heads are not a whole multiple of "
                             f"{self.num_kv_heads} KV heads")

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads


#: `NUM_HEADS` / `NUM_KV_HEADS` / `HEAD_SIZE`.
DEFAULT_HEADS = HeadShape(NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE)
#: Default tokens per KV-cache block (`PagedKV` and the bench functions take their own).
BLOCK_SIZE = 16


def _sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, *, budget_ms: float = 400.0) -> float:
    """Median milliseconds of device time per call of `fn`, after a warm-up.

    On CUDA each sample is a run of back-to-back calls (about 2 ms in all) between two CUDA
    events, after an L2 flush (256 MB written) and a GPU spin long enough for the host to
    queue the whole run: the device never waits for the host, as in a multi-layer forward
    whose host runs ahead, so the figure is the calls' device time and counts none of the
    bench's (or the backend's) Python. `host_ms` measures that host side separately.
    """
    import torch

    for _ in range(2):
        fn()
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    once = (time.perf_counter() - t0) * 1e3
    reps = int(min(30, max(3, budget_ms / max(once, 1e-3))))
    times = []
    if device.type == "cuda":
        host = host_ms(fn, device)
        inner = int(min(50, max(1, 2.0 / max(once, 1e-3))))
        flush = torch.empty(256 << 20, dtype=torch.int8, device=device)
        # ~2e6 SM cycles per ms (H100/H200 clocks); twice the host's time for the run.
        spin = int(min(50.0, 2.0 * host * inner + 0.2) * 2e6)
        for _ in range(reps):
            flush.zero_()
            torch.cuda._sleep(spin)  # type: ignore[no-untyped-call]
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            times.append(float(start.elapsed_time(end)) / inner)
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return float(statistics.median(times))


def host_ms(fn: Callable[[], object], device: torch.device, *, calls: int = 20) -> float:
    """Host milliseconds per call of `fn` without waiting for the device (launch cost).

    When this exceeds `time_ms`, a model calling `fn` once per layer is bound by the host
    unless the calls are captured in a CUDA graph.
    """
    fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) * 1e3 / calls
    _sync(device)
    return host


def graph_time_ms(
    fn: Callable[[], object], device: torch.device, *, calls: int = 10, budget_ms: float = 200.0
) -> float:
    """Device milliseconds per call of `fn` replayed from a CUDA graph of `calls` calls.

    `fn` must be capturable (no host reads of device values, static buffers). The graph
    replays `calls` back-to-back calls, timed like `time_ms` (one replay per event pair).
    """
    import torch

    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # warm-up off the default stream, as capture requires
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    _sync(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    _sync(device)
    return time_ms(graph.replay, device, budget_ms=budget_ms) / calls


def kernel_summary(prof: Any, calls: int, top: int = 25) -> list[dict[str, Any]]:
    """The CUDA kernels and copies of a `torch.profiler` run of `calls` repetitions, slowest
    first: ``name``, ``us_per_step`` (own device microseconds per repetition) and
    ``calls_per_step`` (launches per repetition); the first `top`."""
    rows = []
    for ev in prof.key_averages():
        if ev.device_type.name != "CUDA" or ev.self_device_time_total <= 0:
            continue
        rows.append({"name": ev.key[:120], "us_per_step": ev.self_device_time_total / calls,
                     "calls_per_step": ev.count / calls})
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows[:top]


def copy_bandwidth_gbps(device: torch.device, *, quick: bool) -> float:
    """Device-to-device copy of a large buffer: (bytes read + bytes written) / time."""
    import torch

    n = (64 if quick else 2048) << 20
    src = torch.randint(0, 127, (n,), dtype=torch.int8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device)
    return 2 * n / ms / 1e6


class PagedKV:
    """Random K/V of a batch, as contiguous tensors and as a paged ``[2, N, B, Hkv, D]`` cache.

    Parameters
    ----------
    seq_lens:
        Tokens of each request.
    dtype, device:
        Of ``key`` / ``value`` (``[sum(seq_lens), num_kv_heads, head_size]``).
    block_size:
        Tokens per block (B); the block table is a random permutation of blocks ``1..N-1``.
    num_kv_heads, head_size:
        The KV heads' shape (default: the bench's 8 x 128).
    """

    def __init__(
        self, seq_lens: list[int], dtype: torch.dtype, device: torch.device, *,
        block_size: int = BLOCK_SIZE, num_kv_heads: int = NUM_KV_HEADS,
        head_size: int = HEAD_SIZE,
    ) -> None:
        import torch

        if block_size < 1:
            raise ValueError(f"block_size must be a positive number of tokens, got {block_size}")
        self.seq_lens = seq_lens
        self.block_size = block_size
        self.num_kv_heads, self.head_size = num_kv_heads, head_size
        blocks = [math.ceil(s / self.block_size) for s in seq_lens]
        self.num_blocks = 1 + sum(blocks)  # block 0 is the null block
        perm = torch.randperm(self.num_blocks - 1) + 1
        self.block_table = torch.zeros((len(seq_lens), max(blocks)), dtype=torch.int32)
        cursor = 0
        for r, n in enumerate(blocks):
            self.block_table[r, :n] = perm[cursor : cursor + n].to(torch.int32)
            cursor += n
        total = sum(seq_lens)
        shape = (total, num_kv_heads, head_size)
        self.key = torch.randn(shape, dtype=dtype, device=device)
        self.value = torch.randn(shape, dtype=dtype, device=device)
        self.slots = torch.cat([self.slots_of(r, 0, s) for r, s in enumerate(seq_lens)])
        self.slots = self.slots.to(device)
        self.block_table = self.block_table.to(device)

    def slots_of(self, req: int, begin: int, end: int) -> torch.Tensor:
        import torch

        pos = torch.arange(begin, end)
        table = self.block_table[req].cpu().to(torch.int64)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def token_slice(self, req: int) -> slice:
        start = sum(self.seq_lens[:req])
        return slice(start, start + self.seq_lens[req])

    def new_tokens(self, q_lens: list[int], reqs: list[int]) -> torch.Tensor:
        """Flat indices into `key`/`value` of the new tokens of a step (see `common`)."""
        import torch

        idx = [
            torch.arange(self.token_slice(r).stop - q, self.token_slice(r).stop)
            for r, q in zip(reqs, q_lens, strict=True)
        ]
        return torch.cat(idx).to(self.key.device)

    def paged(self) -> torch.Tensor:
        """The comparators' own paged cache (reference layout)."""
        import torch

        cache = torch.zeros(
            (2, self.num_blocks * self.block_size, self.num_kv_heads, self.head_size),
            dtype=self.key.dtype,
            device=self.key.device,
        )
        cache[0, self.slots] = self.key
        cache[1, self.slots] = self.value
        return cache.view(2, self.num_blocks, self.block_size, self.num_kv_heads,
                          self.head_size)

    def common(self, q_lens: list[int], reqs: list[int]) -> CommonAttentionMetadata:
        """Metadata of a step in which request ``reqs[i]`` has its last ``q_lens[i]`` tokens new."""
        import torch

        from pagedcore.attention import CommonAttentionMetadata

        dev = self.key.device
        lens = [self.seq_lens[r] for r in reqs]
        qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
        seq = torch.tensor(lens, dtype=torch.int32)
        triples = list(zip(reqs, lens, q_lens, strict=True))
        slots = torch.cat([self.slots_of(r, s - q, s) for r, s, q in triples])
        pos = torch.cat([torch.arange(s - q, s) for _, s, q in triples])
        return CommonAttentionMetadata(
            query_start_loc=qsl.to(dev),
            query_start_loc_cpu=qsl,
            seq_lens=seq.to(dev),
            seq_lens_cpu=seq,
            num_reqs=len(reqs),
            num_actual_tokens=sum(q_lens),
            max_query_len=max(q_lens),
            max_seq_len=max(lens),
            block_table=self.block_table[reqs].contiguous(),
            slot_mapping=slots.to(dev),
            positions=pos.to(dev),
        )


class BackendUnderTest:
    """One backend's cache (filled by its own cache write), builder and impl for a batch
    (`num_heads` query heads over `kv`'s KV heads; default the bench's 32)."""

    def __init__(
        self, backend: type[AttentionBackend], kv: PagedKV, *, kv_cache_dtype: str = "auto",
        sinks: list[float] | None = None, num_heads: int = NUM_HEADS,
    ) -> None:
        import torch

        from pagedcore.attention.kv_quant import (
            FP8_MAX,
            kv_cache_torch_dtype,
            normalize_kv_cache_dtype,
        )
        from pagedcore.kv_cache.spec import FullAttentionSpec

        dtype, device, block_size = kv.key.dtype, kv.key.device, kv.block_size
        hkv, head_size = kv.num_kv_heads, kv.head_size
        # Backends see the normalized names only ("fp8" -> "fp8_e4m3"), as from the engine.
        kv_cache_dtype = normalize_kv_cache_dtype(kv_cache_dtype)
        self.backend = backend
        shape = backend.get_kv_cache_shape(
            kv.num_blocks, block_size, hkv, head_size, kv_cache_dtype
        )
        cache_dtype = kv_cache_torch_dtype(kv_cache_dtype, dtype)
        self.kv_cache = torch.empty(shape, dtype=cache_dtype, device=device)
        k_scale = v_scale = 1.0
        if cache_dtype != dtype:  # fp8: per-tensor scales from the data (amax / fp8 max)
            bound = FP8_MAX[kv_cache_dtype]
            k_scale = float(kv.key.abs().amax()) / bound
            v_scale = float(kv.value.abs().amax()) / bound
        # The spec carries the cache's dtype, as the engine's do (an fp8 cache: 1-byte elements,
        # which a builder may plan by).
        spec = FullAttentionSpec(
            block_size=block_size, num_kv_heads=hkv, head_size=head_size,
            dtype=cache_dtype,
        )
        self.builder = backend.get_builder_cls()(spec, ["bench"], device)
        self.impl = backend.get_impl_cls()(
            num_heads, head_size, head_size**-0.5, num_kv_heads=hkv,
            kv_cache_dtype=kv_cache_dtype, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
        )
        chunk = 1 << 16
        for start in range(0, kv.key.shape[0], chunk):
            sl = slice(start, start + chunk)
            self.impl.do_kv_cache_update(kv.key[sl], kv.value[sl], self.kv_cache, kv.slots[sl])

    def runner(
        self, kv: PagedKV, q_lens: list[int], reqs: list[int], query: torch.Tensor
    ) -> Callable[[], Any]:
        """A closure timing one ``forward`` of the step (the plan is built outside it)."""
        import torch

        metadata = self.builder.build(kv.common(q_lens, reqs))
        idx = kv.new_tokens(q_lens, reqs)
        key, value = kv.key[idx], kv.value[idx]
        out = torch.empty_like(query)
        impl, cache = self.impl, self.kv_cache

        def run() -> Any:
            return impl.forward(query, key, value, cache, metadata, output=out)

        return run

    def capture_runner(
        self, kv: PagedKV, reqs: list[int], query: torch.Tensor, *, max_seq_len: int
    ) -> Callable[[], Any] | None:
        """Like `runner` for a single-token decode of `reqs`, planned for CUDA-graph capture.

        The plan comes from ``build_for_cudagraph_capture`` with ``max_seq_len`` as the
        longest sequence a replay may hold; None when the backend declares no graph support.
        """
        import torch

        from pagedcore.attention import CommonAttentionMetadata, CudaGraphSupport

        if self.backend.cudagraph_support < CudaGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE:
            return None
        common = kv.common([1] * len(reqs), reqs)
        fields = {a.name: getattr(common, a.name) for a in attrs.fields(type(common))}
        common = CommonAttentionMetadata(**{**fields, "max_seq_len": max_seq_len})
        metadata = self.builder.build_for_cudagraph_capture(common)
        idx = kv.new_tokens([1] * len(reqs), reqs)
        key, value = kv.key[idx], kv.value[idx]
        out = torch.empty_like(query)
        impl, cache = self.impl, self.kv_cache

        def run() -> Any:
            return impl.forward(query, key, value, cache, metadata, output=out)

        return run


def sdpa_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool
) -> torch.Tensor:
    """``q [B, Hq, L, D]``, ``k, v [B, Hkv, S, D]`` -> ``[B, Hq, L, D]`` (GQA via enable_gqa)."""
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error of ``a`` against ``b`` (any shapes that match), in float32."""
    return float((a.float() - b.float()).norm() / b.float().norm())


def failure_row(case: str, shape: str, name: str, exc: Exception) -> dict[str, Any]:
    """The row a backend's failure leaves in a bench table (and says on stderr)."""
    import click

    click.echo(f"{name} failed on {case} {shape}: {type(exc).__name__}: {exc}", err=True)
    return {"case": case, "shape": shape, "impl": name, "error": f"{type(exc).__name__}: {exc}"}
