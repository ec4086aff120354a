"""`pagedcore bench kernels`: attention kernels of any backend against the device's ceilings.

Generic over backends: each one's cache is allocated with ``get_kv_cache_shape``, filled by its
own ``do_kv_cache_update``, planned by its own builder, and only ``impl.forward`` is timed. In
the same run it measures a large device-to-device copy (bytes read + written), torch SDPA on a
contiguous KV cache (``enable_gqa=True``, no K/V expansion) and a naive gather-then-SDPA over a
paged cache.

Cases (bf16, 32 query heads / 8 KV heads, head size 128, block size 16): decode at
batch x context 64x4096, 8x32768, 256x1024; causal prefill of 4x2048 and 4x8192 tokens; a mixed
batch of 64 decodes (context 4096) plus one 2,048-token chunk continuing a 2,048-token cached
prefix, against the decode and prefill parts run as two separate ``forward`` calls.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    import torch

    from pagedcore.attention import AttentionBackend, CommonAttentionMetadata

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 8, 128, 16
FULL: dict[str, list[tuple[int, ...]]] = {
    "decode": [(64, 4096), (8, 32768), (256, 1024)],
    "prefill": [(4, 2048), (4, 8192)],
    "mixed": [(64, 4096, 2048, 2048)],  # decodes, their context, chunk tokens, cached prefix
}
QUICK: dict[str, list[tuple[int, ...]]] = {
    "decode": [(8, 1024)],
    "prefill": [(1, 512)],
    "mixed": [(8, 1024, 256, 256)],
}


def _sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, *, budget_ms: float = 400.0) -> float:
    """Median milliseconds per call of `fn`, after a warm-up.

    On CUDA each sample is a run of back-to-back calls between two CUDA events, L2 flushed
    (256 MB written) before it: the host's launch latency overlaps the previous call, as in a
    multi-layer forward, instead of being counted as kernel time.
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
        inner = int(min(20, max(1, 1.0 / max(once, 1e-3))))
        flush = torch.empty(256 << 20, dtype=torch.int8, device=device)
        for _ in range(reps):
            flush.zero_()
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


def copy_bandwidth_gbps(device: torch.device, *, quick: bool) -> float:
    """Device-to-device copy of a large buffer: (bytes read + bytes written) / time."""
    import torch

    n = (64 if quick else 2048) << 20
    src = torch.randint(0, 127, (n,), dtype=torch.int8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device)
    return 2 * n / ms / 1e6


class PagedKV:
    """Random K/V of a batch, as contiguous tensors and as a paged ``[2, N, B, Hkv, D]`` cache."""

    def __init__(self, seq_lens: list[int], dtype: torch.dtype, device: torch.device) -> None:
        import torch

        self.seq_lens = seq_lens
        blocks = [math.ceil(s / BLOCK_SIZE) for s in seq_lens]
        self.num_blocks = 1 + sum(blocks)  # block 0 is the null block
        perm = torch.randperm(self.num_blocks - 1) + 1
        self.block_table = torch.zeros((len(seq_lens), max(blocks)), dtype=torch.int32)
        cursor = 0
        for r, n in enumerate(blocks):
            self.block_table[r, :n] = perm[cursor : cursor + n].to(torch.int32)
            cursor += n
        total = sum(seq_lens)
        shape = (total, NUM_KV_HEADS, HEAD_SIZE)
        self.key = torch.randn(shape, dtype=dtype, device=device)
        self.value = torch.randn(shape, dtype=dtype, device=device)
        self.slots = torch.cat([self.slots_of(r, 0, s) for r, s in enumerate(seq_lens)])
        self.slots = self.slots.to(device)
        self.block_table = self.block_table.to(device)

    def slots_of(self, req: int, begin: int, end: int) -> torch.Tensor:
        import torch

        pos = torch.arange(begin, end)
        table = self.block_table[req].cpu().to(torch.int64)
        return table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE

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
            (2, self.num_blocks * BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE),
            dtype=self.key.dtype,
            device=self.key.device,
        )
        cache[0, self.slots] = self.key
        cache[1, self.slots] = self.value
        return cache.view(2, self.num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)

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
    """One backend's cache (filled by its own cache write), builder and impl for a batch."""

    def __init__(self, backend: type[AttentionBackend], kv: PagedKV) -> None:
        import torch

        from pagedcore.kv_cache.spec import FullAttentionSpec

        dtype, device = kv.key.dtype, kv.key.device
        shape = backend.get_kv_cache_shape(kv.num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
        self.kv_cache = torch.empty(shape, dtype=dtype, device=device)
        spec = FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=dtype
        )
        self.builder = backend.get_builder_cls()(spec, ["bench"], device)
        self.impl = backend.get_impl_cls()(
            NUM_HEADS, HEAD_SIZE, HEAD_SIZE**-0.5, num_kv_heads=NUM_KV_HEADS
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


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool) -> torch.Tensor:
    """``q [B, Hq, L, D]``, ``k, v [B, Hkv, S, D]`` -> ``[B, Hq, L, D]`` (GQA via enable_gqa)."""
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def bench_uniform(
    kind: str, batch: int, length: int, backends: list[type[AttentionBackend]],
    device: torch.device, copy_gbps: float,
) -> list[dict[str, Any]]:
    """Decode (one new token over `length`) or causal prefill (`length` new tokens)."""
    import torch

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kv = PagedKV([length] * batch, dtype, device)
    q_len = 1 if kind == "decode" else length
    query = torch.randn((batch * q_len, NUM_HEADS, HEAD_SIZE), dtype=dtype, device=device)
    k4 = kv.key.view(batch, length, NUM_KV_HEADS, HEAD_SIZE).transpose(1, 2).contiguous()
    v4 = kv.value.view(batch, length, NUM_KV_HEADS, HEAD_SIZE).transpose(1, 2).contiguous()
    q4 = query.view(batch, q_len, NUM_HEADS, HEAD_SIZE).transpose(1, 2)
    causal = kind == "prefill"
    ref = _sdpa(q4, k4, v4, causal=causal).transpose(1, 2).reshape(query.shape)
    kv_bytes = 2 * batch * length * NUM_KV_HEADS * HEAD_SIZE * dtype.itemsize
    flops = 4 * HEAD_SIZE * NUM_HEADS * batch * (length * (length + 1) // 2 if causal else length)
    shape = f"{batch}x{length}"
    rows: list[dict[str, Any]] = []

    def row(name: str, ms: float, err: float | None) -> None:
        rows.append({
            "case": kind, "shape": shape, "impl": name, "ms": ms,
            "kv_GBps": kv_bytes / ms / 1e6, "pct_copy": 100 * kv_bytes / ms / 1e6 / copy_gbps,
            "TFLOPs": flops / ms / 1e9, "rel_err_vs_sdpa": err,
        })

    def sdpa() -> torch.Tensor:
        return _sdpa(q4, k4, v4, causal=causal)

    row("sdpa-contiguous(enable_gqa)", time_ms(sdpa, device), None)
    if kind == "decode":
        paged = kv.paged()
        table = kv.block_table

        def naive() -> torch.Tensor:
            k = paged[0][table].view(batch, -1, NUM_KV_HEADS, HEAD_SIZE)[:, :length]
            v = paged[1][table].view(batch, -1, NUM_KV_HEADS, HEAD_SIZE)[:, :length]
            return _sdpa(q4, k.transpose(1, 2), v.transpose(1, 2), causal=False)

        row("naive-gather+sdpa", time_ms(naive, device), None)
        del paged
    for backend in backends:
        try:
            under = BackendUnderTest(backend, kv)
            run = under.runner(kv, [q_len] * batch, list(range(batch)), query)
            out = run()
            row(backend.name, time_ms(run, device), _rel(out, ref))
            del under
        except Exception as exc:  # one failing backend must not sink the others' figures
            rows.append(_failure(kind, shape, backend.name, exc))
    ref_ms = rows[0]["ms"]
    for r in rows:
        if "ms" in r:
            r["speed_vs_sdpa"] = ref_ms / r["ms"]
    return rows


def _failure(case: str, shape: str, name: str, exc: Exception) -> dict[str, Any]:
    click.echo(f"{name} failed on {case} {shape}: {type(exc).__name__}: {exc}", err=True)
    return {"case": case, "shape": shape, "impl": name, "error": f"{type(exc).__name__}: {exc}"}


def _chain(*fns: Callable[[], Any]) -> Callable[[], None]:
    def run() -> None:
        for fn in fns:
            fn()

    return run


def bench_mixed(
    decodes: int, ctx: int, chunk: int, prefix: int, backends: list[type[AttentionBackend]],
    device: torch.device,
) -> list[dict[str, Any]]:
    """One forward over decodes + a prefill chunk vs the two parts as separate forwards."""
    import torch

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kv = PagedKV([ctx] * decodes + [prefix + chunk], dtype, device)
    q_lens = [1] * decodes + [chunk]
    query = torch.randn((sum(q_lens), NUM_HEADS, HEAD_SIZE), dtype=dtype, device=device)
    rows: list[dict[str, Any]] = []
    shape = f"{decodes}x{ctx}+{chunk}@{prefix}"
    for backend in backends:
        try:
            rows.append(_mixed_row(backend, kv, q_lens, query, shape, device))
        except Exception as exc:
            rows.append(_failure("mixed", shape, backend.name, exc))
    return rows


def _mixed_row(
    backend: type[AttentionBackend], kv: PagedKV, q_lens: list[int], query: torch.Tensor,
    shape: str, device: torch.device,
) -> dict[str, Any]:
    import torch

    decodes, chunk = len(q_lens) - 1, q_lens[-1]
    under = BackendUnderTest(backend, kv)
    run_mixed = under.runner(kv, q_lens, list(range(decodes + 1)), query)
    run_dec = under.runner(kv, [1] * decodes, list(range(decodes)), query[:decodes])
    run_pre = under.runner(kv, [chunk], [decodes], query[decodes:])
    separate = time_ms(_chain(run_dec, run_pre), device)
    both = time_ms(run_mixed, device)
    out_mixed = run_mixed().clone()
    parts = torch.cat([run_dec(), run_pre()])
    return {
        "case": "mixed", "shape": shape, "impl": backend.name, "ms": both,
        "separate_ms": separate, "mixed_over_separate": both / separate,
        "rel_err_mixed_vs_separate": _rel(out_mixed, parts),
    }


def _pick_backends(names: tuple[str, ...], device: torch.device) -> tuple[list[Any], list[str]]:
    from pagedcore.attention import AttentionConfig
    from pagedcore.plugins.registry import get_registry

    registry = get_registry()
    wanted = list(names) or list(registry.backends)
    cfg = AttentionConfig(
        head_size=HEAD_SIZE, block_size=BLOCK_SIZE, device=device.type,
        dtype="bfloat16" if device.type == "cuda" else "float32",
    )
    chosen, skipped = [], []
    for name in wanted:
        backend = registry.get(name)
        reasons = backend.validate_configuration(cfg)
        if reasons:
            if names:
                why = "; ".join(reasons)
                raise click.UsageError(f"backend {name!r} cannot run this bench: {why}")
            skipped.append(f"{name}: {'; '.join(reasons)}")
        else:
            chosen.append(backend)
    return chosen, skipped


def _print_table(rows: list[dict[str, Any]], copy_gbps: float) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"attention kernels (copy bandwidth {copy_gbps:.0f} GB/s)")
    cols = ["case", "shape", "impl", "ms", "kv_GBps", "pct_copy", "TFLOPs", "speed_vs_sdpa",
            "separate_ms", "mixed_over_separate", "rel_err_vs_sdpa", "rel_err_mixed_vs_separate",
            "error"]
    for c in cols:
        table.add_column(c)
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c)
            if v is None or (c in ("kv_GBps", "pct_copy") and r["case"] == "prefill") or (
                    c == "TFLOPs" and r["case"] == "decode"):
                cells.append("")
            else:
                cells.append(f"{v:.3g}" if isinstance(v, float) else str(v))
        table.add_row(*cells)
    Console(width=220).print(table)


@click.command()
@click.option(
    "--backend", "names", multiple=True, help="Backend to time (repeatable; default: all)."
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write figures here.")
@click.option("--quick", is_flag=True, help="Tiny shapes (a smoke test, also on CPU).")
def kernels(names: tuple[str, ...], json_path: str | None, quick: bool) -> None:
    """Time attention kernels (decode, prefill, mixed) against copy bandwidth and torch SDPA."""
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not quick:
        raise click.UsageError("no CUDA device: the full bench needs a GPU; pass --quick for a "
                               "CPU smoke run")
    torch.manual_seed(0)
    backends, skipped = _pick_backends(names, device)
    for s in skipped:
        click.echo(f"skipped {s}", err=True)
    shapes = QUICK if quick else FULL
    copy_gbps = copy_bandwidth_gbps(device, quick=quick)
    rows: list[dict[str, Any]] = []
    for kind in ("decode", "prefill"):
        for batch, length in shapes[kind]:
            rows += bench_uniform(kind, batch, length, backends, device, copy_gbps)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    for decodes, ctx, chunk, prefix in shapes["mixed"]:
        rows += bench_mixed(decodes, ctx, chunk, prefix, backends, device)
    _print_table(rows, copy_gbps)
    if json_path:
        command = ["pagedcore bench kernels"]
        command += [f"--backend {n}" for n in names] + (["--quick"] if quick else [])
        command.append(f"--json {json_path}")
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
        info = {
            "command": " ".join(command),
            "git_commit": commit.stdout.strip() if commit.returncode == 0 else None,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "config": {"dtype": "bfloat16" if device.type == "cuda" else "float32",
                       "num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS,
                       "head_size": HEAD_SIZE, "block_size": BLOCK_SIZE,
                       "sdpa": "torch SDPA on contiguous [B, H, S, D], enable_gqa=True",
                       "timing": "median over samples of CUDA-event time per call; a sample is "
                                 "up to 20 back-to-back calls (about 1 ms) after an L2 flush"},
            "copy_bandwidth_GBps": copy_gbps,
            "skipped": skipped,
            "results": rows,
        }
        with open(json_path, "w") as f:
            json.dump(info, f, indent=2)
        click.echo(f"wrote {json_path}")
