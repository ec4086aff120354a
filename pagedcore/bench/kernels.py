"""`pagedcore bench kernels`: attention kernels of any backend against the device's ceilings.

Generic over backends: each one's cache is allocated with ``get_kv_cache_shape``, filled by its
own ``do_kv_cache_update``, planned by its own builder, and only ``impl.forward`` is timed. In
the same run it measures a large device-to-device copy (bytes read + written), torch SDPA on a
contiguous KV cache (``enable_gqa=True``, no K/V expansion) and a naive gather-then-SDPA over a
paged cache.

Cases (bf16, 32 query heads / 8 KV heads, head size 128 unless ``--heads`` / ``--head-size``
say otherwise, block size 16): decode at batch x context 64x4096, 8x32768, 256x1024
(``--decode-shapes`` replaces them); causal prefill of 4x2048 and 4x8192 tokens; a mixed
batch of 64 decodes (context 4096) plus one 2,048-token chunk continuing a 2,048-token cached
prefix, against the decode and prefill parts run as two separate ``forward`` calls; for
backends that declare ``supports_cascade``, the ``cascade`` case (issue #26's target: 64
decodes sharing a 4,096-token prefix in the same blocks plus 256 own tokens each), planned
plainly and with ``common_prefix_len``, and the same batch with private prefixes
(`pagedcore.bench.kernels_cascade`).

Decode rows of backends that support CUDA graphs get a second row, ``NAME+cudagraph``: the
step planned by ``build_for_cudagraph_capture`` and replayed from a captured graph.

The measuring primitives (`time_ms`, `PagedKV`, `BackendUnderTest`, ...) live in
`pagedcore.bench.kernel_primitives` and are re-exported here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

from pagedcore.bench.kernel_primitives import (
    BLOCK_SIZE,
    DEFAULT_HEADS,
    HEAD_SIZE,
    NUM_HEADS,
    NUM_KV_HEADS,
    BackendUnderTest,
    HeadShape,
    PagedKV,
    copy_bandwidth_gbps,
    graph_time_ms,
    host_ms,
    time_ms,
)
from pagedcore.bench.kernel_primitives import (
    failure_row as _failure,
)
from pagedcore.bench.kernel_primitives import (
    rel_error as _rel,
)
from pagedcore.bench.kernel_primitives import (
    sdpa_reference as _sdpa,
)
from pagedcore.bench.report import git_commit
from pagedcore.cli_progress import progress_bar
from pagedcore.cli_types import BACKEND, OutputPath

if TYPE_CHECKING:
    import torch

    from pagedcore.attention import AttentionBackend

__all__ = [
    "BLOCK_SIZE", "FULL", "HEAD_SIZE", "NUM_HEADS", "NUM_KV_HEADS", "QUICK", "BackendUnderTest",
    "HeadShape", "PagedKV", "bench_mixed", "bench_uniform", "copy_bandwidth_gbps",
    "head_options", "kernels", "parse_heads", "time_ms",
]

FULL: dict[str, list[tuple[int, ...]]] = {
    "decode": [(64, 4096), (8, 32768), (256, 1024)],
    "prefill": [(4, 2048), (4, 8192)],
    "mixed": [(64, 4096, 2048, 2048)],  # decodes, their context, chunk tokens, cached prefix
    "cascade": [(64, 4096, 256)],  # decodes sharing a prefix of that many tokens, own tokens
}
QUICK: dict[str, list[tuple[int, ...]]] = {
    "decode": [(8, 1024)],
    "prefill": [(1, 512)],
    "mixed": [(8, 1024, 256, 256)],
    "cascade": [(4, 64, 16)],
}


def bench_uniform(
    kind: str, batch: int, length: int, backends: list[type[AttentionBackend]],
    device: torch.device, copy_gbps: float, *, block_size: int = BLOCK_SIZE,
    kv_cache_dtype: str = "auto", sinks: bool = False, heads: HeadShape = DEFAULT_HEADS,
) -> list[dict[str, Any]]:
    """Decode (one new token over `length`) or causal prefill (`length` new tokens), with
    `heads` (query heads, KV heads, head size; Llama-3-8B's 32 / 8 / 128 by default).

    One row per implementation (SDPA on contiguous K/V, for decode a naive gather + SDPA over
    the paged cache, then each backend over a cache of `block_size`-token blocks); a backend
    that raises gets a row with ``error``. With an fp8 `kv_cache_dtype` the backends' caches
    are fp8 (per-tensor scales from the data) and their ``kv_GBps`` / ``pct_copy`` count the
    fp8 bytes; with `sinks` every backend layer carries per-head sink logits (their
    ``rel_err_vs_sdpa`` is then None: SDPA has no sinks).
    """
    import torch

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hq, hkv, d = heads.num_heads, heads.num_kv_heads, heads.head_size
    kv = PagedKV([length] * batch, dtype, device, block_size=block_size, num_kv_heads=hkv,
                 head_size=d)
    q_len = 1 if kind == "decode" else length
    query = torch.randn((batch * q_len, hq, d), dtype=dtype, device=device)
    k4 = kv.key.view(batch, length, hkv, d).transpose(1, 2).contiguous()
    v4 = kv.value.view(batch, length, hkv, d).transpose(1, 2).contiguous()
    q4 = query.view(batch, q_len, hq, d).transpose(1, 2)
    causal = kind == "prefill"
    ref = _sdpa(q4, k4, v4, causal=causal).transpose(1, 2).reshape(query.shape)
    kv_bytes = 2 * batch * length * hkv * d * dtype.itemsize
    flops = 4 * d * hq * batch * (length * (length + 1) // 2 if causal else length)
    shape = f"{batch}x{length}"
    rows: list[dict[str, Any]] = []

    def row(name: str, ms: float, err: float | None, *, nbytes: int = kv_bytes,
            **extra: Any) -> None:
        rows.append({
            "case": kind, "shape": shape, "impl": name, "ms": ms,
            "kv_GBps": nbytes / ms / 1e6, "pct_copy": 100 * nbytes / ms / 1e6 / copy_gbps,
            "TFLOPs": flops / ms / 1e9, "rel_err_vs_sdpa": err, **extra,
        })

    def sdpa() -> torch.Tensor:
        return _sdpa(q4, k4, v4, causal=causal)

    row("sdpa-contiguous(enable_gqa)", time_ms(sdpa, device), None)
    if kind == "decode":
        paged = kv.paged()
        table = kv.block_table

        def naive() -> torch.Tensor:
            k = paged[0][table].view(batch, -1, hkv, d)[:, :length]
            v = paged[1][table].view(batch, -1, hkv, d)[:, :length]
            return _sdpa(q4, k.transpose(1, 2), v.transpose(1, 2), causal=False)

        row("naive-gather+sdpa", time_ms(naive, device), None)
        del paged
    sink_logits = [(-1.0 + 0.125 * h) for h in range(hq)] if sinks else None
    for backend in backends:
        try:
            under = BackendUnderTest(backend, kv, kv_cache_dtype=kv_cache_dtype,
                                     sinks=sink_logits, num_heads=hq)
            nbytes = kv_bytes * under.kv_cache.dtype.itemsize // dtype.itemsize
            run = under.runner(kv, [q_len] * batch, list(range(batch)), query)
            out = run()
            host = host_ms(run, device) if device.type == "cuda" else None
            err = None if sinks else _rel(out, ref)
            row(backend.name, time_ms(run, device), err, host_ms=host, nbytes=nbytes)
            if kind == "decode" and device.type == "cuda":
                _graph_row(under, kv, query, None if sinks else ref, row, nbytes)
            del under
        except Exception as exc:  # one failing backend must not sink the others' figures
            rows.append(_failure(kind, shape, backend.name, exc))
    ref_ms = rows[0]["ms"]
    for r in rows:
        if "ms" in r:
            r["speed_vs_sdpa"] = ref_ms / r["ms"]
    return rows


def _graph_row(
    under: BackendUnderTest, kv: PagedKV, query: torch.Tensor, ref: torch.Tensor | None,
    row: Callable[..., None], nbytes: int,
) -> None:
    """A "NAME+cudagraph" row: the decode planned for capture, replayed from a CUDA graph."""
    name = f"{under.backend.name}+cudagraph"
    try:
        reqs = list(range(len(kv.seq_lens)))
        graphed = under.capture_runner(kv, reqs, query, max_seq_len=max(kv.seq_lens))
        if graphed is not None:
            out = graphed()
            err = None if ref is None else _rel(out, ref)
            row(name, graph_time_ms(graphed, query.device), err, nbytes=nbytes)
    except Exception as exc:
        click.echo(f"{name} failed: {type(exc).__name__}: {exc}", err=True)
        row(name, float("nan"), None, error=f"{type(exc).__name__}: {exc}")


def _chain(*fns: Callable[[], Any]) -> Callable[[], None]:
    def run() -> None:
        for fn in fns:
            fn()

    return run


def bench_mixed(
    decodes: int, ctx: int, chunk: int, prefix: int, backends: list[type[AttentionBackend]],
    device: torch.device, *, block_size: int = BLOCK_SIZE, heads: HeadShape = DEFAULT_HEADS,
) -> list[dict[str, Any]]:
    """One forward over decodes + a prefill chunk vs the two parts as separate forwards."""
    import torch

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kv = PagedKV([ctx] * decodes + [prefix + chunk], dtype, device, block_size=block_size,
                 num_kv_heads=heads.num_kv_heads, head_size=heads.head_size)
    q_lens = [1] * decodes + [chunk]
    query = torch.randn((sum(q_lens), heads.num_heads, heads.head_size), dtype=dtype,
                        device=device)
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
    under = BackendUnderTest(backend, kv, num_heads=query.shape[1])
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


def _pick_backends(
    names: tuple[str, ...], device: torch.device, *, block_size: int = BLOCK_SIZE,
    kv_cache_dtype: str = "auto", sinks: bool = False, heads: HeadShape = DEFAULT_HEADS,
) -> tuple[list[Any], list[str]]:
    """The backends of `names` (all registered when empty) that accept the bench's config.

    A named backend that cannot run is a usage error; unnamed ones are skipped with a reason.
    """
    from pagedcore.attention import AttentionConfig
    from pagedcore.plugins.registry import get_registry

    registry = get_registry()
    wanted = list(names) or list(registry.backends)
    cfg = AttentionConfig(
        head_size=heads.head_size, block_size=block_size, device=device.type,
        dtype="bfloat16" if device.type == "cuda" else "float32",
        kv_cache_dtype=kv_cache_dtype, has_sink=sinks,
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
    cols = ["case", "shape", "impl", "ms", "host_ms", "kv_GBps", "pct_copy", "TFLOPs",
            "speed_vs_sdpa", "separate_ms", "mixed_over_separate", "plain_ms", "speedup",
            "unshared_ms", "rel_err_vs_sdpa",
            "rel_err_mixed_vs_separate", "error"]
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


def head_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--heads Q/KV`` and ``--head-size`` (both None when not given; `parse_heads` turns them
    into a `HeadShape`), shared by `pagedcore bench kernels` and `pagedcore bench backends`."""
    fn = click.option("--head-size", default=None, type=click.IntRange(min=1),
                      help=f"Head size of every case (default {HEAD_SIZE}; e.g. 64: "
                           "Qwen2-0.5B).")(fn)
    return click.option("--heads", "heads_text", default=None, metavar="Q/KV",
                        help=f"Query heads / KV heads of every case (default "
                             f"{NUM_HEADS}/{NUM_KV_HEADS}; e.g. 14/2: Qwen2-0.5B).")(fn)


@click.command()
@click.option(
    "--backend", "names", multiple=True, type=BACKEND,
    help="Backend to time (repeatable; default: all).",
)
@click.option("--json", "json_path", type=OutputPath(), help="Write figures here.")
@click.option("--quick", is_flag=True, help="Tiny shapes (a smoke test, also on CPU).")
@click.option(
    "--kv-cache-dtype", type=click.Choice(["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]),
    default="auto", show_default=True,
    help="Backends' KV-cache dtype (fp8: per-tensor scales from the data).",
)
@click.option("--sinks", is_flag=True, help="Give every layer per-head attention-sink logits.")
@click.option(
    "--case", "cases", multiple=True, type=click.Choice(["decode", "prefill", "mixed", "cascade"]),
    help="Run only these cases (repeatable; default: all).",
)
@head_options
@click.option(
    "--decode-shapes", default=None, metavar="BxC[,BxC...]",
    help="Decode cases as batch x context, replacing the defaults (e.g. 256x560: issue 22's "
         "0.5B decode step).",
)
def kernels(names: tuple[str, ...], json_path: str | None, quick: bool, kv_cache_dtype: str,
            sinks: bool, cases: tuple[str, ...], heads_text: str | None, head_size: int | None,
            decode_shapes: str | None) -> None:
    """Time attention kernels (decode, prefill, mixed) against copy bandwidth and torch SDPA."""
    import torch

    heads = parse_heads(heads_text, head_size)
    shapes = dict(QUICK if quick else FULL)
    if decode_shapes is not None:
        shapes["decode"] = _parse_decode_shapes(decode_shapes)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not quick:
        raise click.UsageError("no CUDA device: the full bench needs a GPU; pass --quick for a "
                               "CPU smoke run")
    torch.manual_seed(0)
    backends, skipped = _pick_backends(names, device, kv_cache_dtype=kv_cache_dtype,
                                       sinks=sinks, heads=heads)
    wanted = set(cases) or {"decode", "prefill", "mixed", "cascade"}
    for s in skipped:
        click.echo(f"skipped {s}", err=True)
    copy_gbps = copy_bandwidth_gbps(device, quick=quick)
    rows: list[dict[str, Any]] = []
    advance = click.get_current_context().with_resource(progress_bar(
        "bench kernels", sum(len(shapes[k]) for k in ("decode", "prefill", "mixed", "cascade"))))

    def save() -> None:  # after every shape: a run cut short keeps what it measured
        if json_path:
            _write_json(json_path, rows, names=names, quick=quick, cases=cases,
                        kv_cache_dtype=kv_cache_dtype, sinks=sinks, device=device,
                        copy_gbps=copy_gbps, skipped=skipped, heads=heads,
                        decode_shapes=decode_shapes)

    for kind in ("decode", "prefill"):
        for batch, length in shapes[kind] if kind in wanted else []:
            rows += bench_uniform(kind, batch, length, backends, device, copy_gbps,
                                  kv_cache_dtype=kv_cache_dtype, sinks=sinks, heads=heads)
            advance(1)
            save()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if kv_cache_dtype == "auto" and not sinks and "mixed" in wanted:
        for decodes, ctx, chunk, prefix in shapes["mixed"]:
            rows += bench_mixed(decodes, ctx, chunk, prefix, backends, device, heads=heads)
            advance(1)
            save()
    if kv_cache_dtype == "auto" and not sinks and "cascade" in wanted:
        from pagedcore.bench.kernels_cascade import bench_cascade

        for num_reqs, prefix, own in shapes["cascade"]:
            rows += bench_cascade(num_reqs, prefix, own, backends, device, heads=heads)
            advance(1)
            save()
    _print_table(rows, copy_gbps)
    if json_path:
        save()
        click.echo(f"wrote {json_path}")


def parse_heads(text: str | None, head_size: int | None) -> HeadShape:
    """`HeadShape` of ``--heads Q/KV`` and ``--head-size`` (a usage error if malformed; either
    left out (None) takes its default, 32/8 and 128)."""
    if text is None:
        text = f"{DEFAULT_HEADS.num_heads}/{DEFAULT_HEADS.num_kv_heads}"
    head_size = DEFAULT_HEADS.head_size if head_size is None else head_size
    q, sep, kv = text.partition("/")
    if not (sep and q.strip().isdecimal() and kv.strip().isdecimal()):
        raise click.BadParameter(f"{text!r}: give query heads / KV heads, e.g. 32/8 or 14/2",
                                 param_hint="--heads")
    try:
        return HeadShape(int(q), int(kv), head_size)
    except ValueError as exc:
        raise click.BadParameter(f"{text!r}: {exc}", param_hint="--heads") from None


def _parse_decode_shapes(text: str) -> list[tuple[int, ...]]:
    """``--decode-shapes`` ``"256x560,64x4096"`` -> ``[(256, 560), (64, 4096)]``."""
    shapes: list[tuple[int, ...]] = []
    for item in (t.strip() for t in text.split(",")):
        batch, sep, ctx = item.partition("x")
        if not (sep and batch.isdecimal() and ctx.isdecimal() and int(batch) > 0 and int(ctx) > 0):
            raise click.BadParameter(
                f"{item!r} in {text!r}: give batch x context with positive integers, e.g. "
                "256x560,64x4096", param_hint="--decode-shapes")
        shapes.append((int(batch), int(ctx)))
    return shapes


def _write_json(json_path: str, rows: list[dict[str, Any]], *, names: tuple[str, ...],
                quick: bool, cases: tuple[str, ...], kv_cache_dtype: str, sinks: bool,
                device: torch.device, copy_gbps: float, skipped: list[str],
                heads: HeadShape = DEFAULT_HEADS, decode_shapes: str | None = None) -> None:
    import torch

    command = ["pagedcore bench kernels"]
    command += [f"--backend {n}" for n in names] + (["--quick"] if quick else [])
    command += [f"--case {c}" for c in cases]
    command += [f"--kv-cache-dtype {kv_cache_dtype}"] if kv_cache_dtype != "auto" else []
    command += ["--sinks"] if sinks else []
    if heads != DEFAULT_HEADS:
        command.append(f"--heads {heads.num_heads}/{heads.num_kv_heads} "
                       f"--head-size {heads.head_size}")
    command += [f"--decode-shapes {decode_shapes}"] if decode_shapes is not None else []
    command.append(f"--json {json_path}")
    info = {
        "command": " ".join(command),
        "git_commit": git_commit(),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "config": {"dtype": "bfloat16" if device.type == "cuda" else "float32",
                   "kv_cache_dtype": kv_cache_dtype, "sinks": sinks,
                   "num_heads": heads.num_heads, "num_kv_heads": heads.num_kv_heads,
                   "head_size": heads.head_size, "block_size": BLOCK_SIZE,
                   "sdpa": "torch SDPA on contiguous [B, H, S, D], enable_gqa=True",
                   "timing": "median over samples of CUDA-event device time per call; a "
                             "sample is ~2 ms of back-to-back calls queued behind a GPU "
                             "spin after an L2 flush (the host runs ahead, as in a "
                             "multi-layer model); host_ms: host time per call, not "
                             "waiting for the device; NAME+cudagraph: the decode planned "
                             "by build_for_cudagraph_capture, replayed from a CUDA graph "
                             "of 10 calls"},
        "copy_bandwidth_GBps": copy_gbps,
        "skipped": skipped,
        "results": rows,
    }
    with open(json_path, "w") as f:
        json.dump(info, f, indent=2)
