"""Split-KV sweep of the Triton decode beside FlashInfer's, in one process (writes JSON).

Issue #21's decode target is the Triton backend within 3 % of FlashInfer at every decode shape;
the shape it missed is few long requests (8 x 32768), where the launch splits each context into
segments (`pagedcore_triton.plan.SplitRule`). This tool times the Triton decode at a shape under
several split plans and decode tile shapes, eager and replayed from a CUDA graph, next to
FlashInfer's tensor-core decode (eager and graph), all through the backends' own builders and
impls (`pagedcore.bench.kernel_primitives`), so a row measures what the backend would run with
that plan as its default.

Every implementation is checked before it is timed: the cache is NaN-poisoned before the K/V
are written (every slot the batch does not own stays NaN), each request is 1-13 tokens short of
the context (partial last blocks), and the output must be finite and within 1e-2 relative
error of float32 SDPA over the same K/V.

Variants (``--variant``, repeatable; default `DEFAULT_VARIANTS`):

* ``default``: the builder's own plan (whatever `SplitRule()` picks for the shape);
* ``S<n>`` (e.g. ``S16``): the uniform plan with exactly ``n`` segments (a power of two);
* ``S<n>@TILE_N,WARPS,STAGES[,FLAG...]``: the same with a decode tile override
  (``PAGEDCORE_TRITON_DECODE_TILES``, see `pagedcore_triton.plan.parse_decode_tiles`);
* ``balanced`` / ``balanced:<target_programs>``: the length-balanced grid (graph rows only: an
  eager step of equal lengths never takes it, see `balanced_pays`).

Usage::

    python backends/triton/tools/split_sweep.py OUT.json [--shape 8x32768 ...] \
        [--variant S16 ...] [--flashinfer] [--seconds 40] [--jobs 8] [--compile-only]

On CUDA the variants' kernels are first compiled by a pool of ``--jobs`` processes (sharing
Triton's cache) on tiny caches with the full launches' specialization. ``--device cpu`` runs
the same logic under ``TRITON_INTERPRET=1`` on tiny shapes (the tests do).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

DEFAULT_SHAPES = ["8x32768"]
#: ``(query heads, KV heads, head size)`` of the sweep (``--heads``; default the bench's).
HEADS: tuple[int, int, int] = (32, 8, 128)
DEFAULT_VARIANTS = [
    "default", "S8", "S16", "S32", "S8@64,4,2,i32", "S16@64,4,2,i32", "S8@64,4,4,i32",
    "S16@64,4,4,i32", "balanced", "balanced:1024",
]


def parse_variant(text: str) -> dict[str, Any]:
    """``{"name", "segments" (None: the builder's), "tiles" (None), "balanced" (target or
    None)}`` from a ``--variant`` value.

    >>> parse_variant("S16@64,4,2,i32")["segments"], parse_variant("balanced:1024")["balanced"]
    (16, 1024)
    """
    name = text.strip()
    out: dict[str, Any] = {"name": name, "segments": None, "tiles": None, "balanced": None}
    head, at, tiles = name.partition("@")
    if at and not tiles:
        head = ""  # "S8@" names no tiles
    if head == "default" and not tiles:
        return out
    if head.startswith("balanced") and not tiles:
        _, _, target = head.partition(":")
        if head in ("balanced", f"balanced:{target}") and (
                target == "" or (target.isdigit() and int(target) > 0)):
            out["balanced"] = int(target) if target else 512
            return out
    if head.startswith("S") and head[1:].isdigit():
        segs = int(head[1:])
        if segs >= 1 and segs & (segs - 1) == 0:
            out["segments"] = segs
            out["tiles"] = tiles or None
            return out
    raise SystemExit(
        f"--variant {text!r}: expected default, S<n> (n a power of two), "
        "S<n>@TILE_N,WARPS,STAGES[,FLAG...] or balanced[:TARGET_PROGRAMS]"
    )


def parse_heads(text: str) -> tuple[int, int, int]:
    """``(Hq, Hkv, D)`` from ``HQ,HKV,D`` (``--heads``; e.g. ``14,2,64``, the Qwen2-0.5B shape).

    >>> parse_heads("14,2,64")
    (14, 2, 64)
    """
    fields = text.split(",")
    if len(fields) == 3 and all(f.strip().isdigit() for f in fields):
        hq, hkv, d = (int(f) for f in fields)
        if hkv > 0 and hq % hkv == 0 and d in (32, 64, 128, 256):
            return hq, hkv, d
    raise SystemExit(f"--heads {text!r}: expected HQ,HKV,D with HQ a multiple of HKV and D one "
                     "of 32, 64, 128, 256, e.g. 14,2,64")


def parse_shape(text: str) -> tuple[int, int]:
    """``(batch, context)`` from ``BxL``."""
    b, _, ln = text.partition("x")
    if not (b.isdigit() and ln.isdigit() and int(b) > 0 and int(ln) > 16):
        raise SystemExit(f"--shape {text!r}: expected BATCHxCONTEXT, e.g. 8x32768")
    return int(b), int(ln)


def seq_lens_of(batch: int, length: int) -> list[int]:
    """Each request 1-13 tokens short of `length` (partial last blocks, NaN tails)."""
    return [length - 1 - (i * 5) % 13 for i in range(batch)]


def _rule(variant: dict[str, Any], segments: int) -> Any:
    """The `SplitRule` that gives exactly `segments` (or the balanced grid)."""
    from pagedcore_triton.plan import SplitRule

    if variant["balanced"] is not None:
        return SplitRule(balanced=True, target_programs=variant["balanced"])
    return SplitRule(min_programs=1 << 30, target_programs=1 << 30, min_tokens_per_segment=1,
                     max_segments=segments)


def _env(variant: dict[str, Any]) -> dict[str, str | None]:
    from pagedcore_triton.plan import DECODE_PLAN_ENV, DECODE_TILES_ENV

    return {DECODE_TILES_ENV: variant["tiles"],
            DECODE_PLAN_ENV: "balanced" if variant["balanced"] is not None else None}


def _set_env(env: dict[str, str | None]) -> None:
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def default_segments(batch: int, length: int) -> int:
    """What the shipped builder gives a bf16 decode of `batch` x `length` (`HEADS`)."""
    import torch
    from pagedcore_triton.metadata import TritonMetadataBuilder

    from pagedcore.bench.kernel_primitives import BLOCK_SIZE
    from pagedcore.kv_cache.spec import FullAttentionSpec

    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=HEADS[1],
                             head_size=HEADS[2], dtype="bfloat16")
    builder = TritonMetadataBuilder(spec, ["sweep"], torch.device("cpu"))
    return builder.decode_segments(num_reqs=batch, max_seq_len=length)


def poisoned(backend: Any, kv: Any) -> Any:
    """`BackendUnderTest` whose cache is NaN wherever the batch wrote nothing."""
    from pagedcore.bench.kernel_primitives import BackendUnderTest

    under = BackendUnderTest(backend, kv, num_heads=HEADS[0])
    under.kv_cache.fill_(float("nan"))
    chunk = 1 << 16
    for start in range(0, kv.key.shape[0], chunk):
        sl = slice(start, start + chunk)
        under.impl.do_kv_cache_update(kv.key[sl], kv.value[sl], under.kv_cache, kv.slots[sl])
    return under


def check(out: Any, ref: Any) -> float:
    """Relative error of `out` against `ref`; raises when non-finite or above 1e-2."""
    import torch

    if not bool(torch.isfinite(out).all()):
        raise RuntimeError("non-finite output (a NaN-poisoned slot was read)")
    err = float((out.float() - ref.float()).norm() / ref.float().norm())
    if err > 1e-2:
        raise RuntimeError(f"relative error {err:.3g} against SDPA")
    return err


def triton_runs(under: Any, kv: Any, query: Any, variant: dict[str, Any], segments: int,
                *, graphs: bool) -> list[tuple[str, Any]]:
    """``[(mode, fn)]`` of one variant: eager (not for balanced) and, with `graphs`, the plan
    for capture. Sets the variant's environment, which the first call of each reads."""
    under.builder.split_rule = _rule(variant, segments)
    _set_env(_env(variant))
    reqs = list(range(len(kv.seq_lens)))
    runs: list[tuple[str, Any]] = []
    if variant["balanced"] is None:
        runs.append(("eager", under.runner(kv, [1] * len(reqs), reqs, query)))
        planned = under.builder.build(kv.common([1] * len(reqs), reqs)).parts[0].num_segments
        if planned != segments:
            raise RuntimeError(f"the builder planned {planned} segments, not {segments}")
    if graphs:
        fn = under.capture_runner(kv, reqs, query, max_seq_len=max(kv.seq_lens))
        if fn is not None:
            runs.append(("graph", fn))
    return runs


def compile_variant(job: tuple[dict[str, Any], int, int, str, tuple[int, int, int]]) -> float:
    """Compile one variant's launches on a tiny cache (same batch: same specialization)."""
    global HEADS
    variant, batch, segments, device, HEADS = job
    import torch
    from pagedcore_triton import TritonAttentionBackend

    from pagedcore.bench.kernel_primitives import PagedKV

    t0 = time.perf_counter()
    dev = torch.device(device)
    hq, hkv, d = HEADS
    kv = PagedKV([max(256, 64 * segments)] * batch, torch.bfloat16, dev, num_kv_heads=hkv,
                 head_size=d)
    query = torch.randn((batch, hq, d), dtype=torch.bfloat16, device=dev)
    under = poisoned(TritonAttentionBackend, kv)
    for _, fn in triton_runs(under, kv, query, variant, segments, graphs=True):
        fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


class Sweep:
    """Rows collected so far, rewritten to `path` after each one (a cut run keeps them)."""

    def __init__(self, path: str, info: dict[str, Any]) -> None:
        self.path = path
        self.info = info
        self.rows: list[dict[str, Any]] = []

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        self.save()

    def save(self) -> None:
        with open(self.path, "w") as f:
            json.dump({**self.info, "rows": self.rows}, f, indent=1)


def reference(kv: Any, query: Any, lens: list[int], length: int) -> Any:
    """Float32 SDPA of the decode over each request's own K/V (``[B, Hq, D]``)."""
    import torch
    import torch.nn.functional as F

    hq, hkv, d = HEADS
    batch, dev = len(lens), query.device

    def contiguous(x: Any) -> Any:
        out = torch.zeros((batch, length, hkv, d), dtype=torch.float32, device=dev)
        for r, n in enumerate(lens):
            out[r, :n] = x[kv.token_slice(r)].float()
        return out.transpose(1, 2)

    mask = torch.zeros((batch, 1, 1, length), dtype=torch.bool, device=dev)
    for r, n in enumerate(lens):
        mask[r, ..., :n] = True
    q4 = query.float().view(batch, 1, hq, d).transpose(1, 2)
    ref = F.scaled_dot_product_attention(q4, contiguous(kv.key), contiguous(kv.value),
                                         attn_mask=mask, enable_gqa=True)
    return ref.transpose(1, 2).reshape(query.shape)


def run_shape(sweep: Sweep, batch: int, length: int, variants: list[dict[str, Any]], *,
              device: Any, copy_gbps: float | None, flashinfer: bool, graphs: bool,
              deadline: float) -> None:
    """All rows of one shape: each Triton variant (eager / graph), FlashInfer (eager / graph)."""
    import torch
    from pagedcore_triton import TritonAttentionBackend

    from pagedcore.bench import kernel_primitives as kp
    from pagedcore.bench.kernel_primitives import PagedKV

    hq, hkv, d = HEADS
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    lens = seq_lens_of(batch, length)
    kv = PagedKV(lens, dtype, device, num_kv_heads=hkv, head_size=d)
    query = torch.randn((batch, hq, d), dtype=dtype, device=device)
    ref = reference(kv, query, lens, length)
    nbytes = 2 * sum(lens) * hkv * d * dtype.itemsize
    shape = f"{batch}x{length}"

    def row(impl: str, mode: str, fn: Any, **extra: Any) -> None:
        if time.time() > deadline:
            sweep.add({"shape": shape, "impl": impl, "mode": mode, "skipped": "time", **extra})
            return
        try:
            err = check(fn(), ref)
            ms = kp.graph_time_ms(fn, device) if mode == "graph" else kp.time_ms(fn, device)
            pct = None if copy_gbps is None else 100 * nbytes / ms / 1e6 / copy_gbps
            sweep.add({"shape": shape, "impl": impl, "mode": mode, "us": round(ms * 1e3, 2),
                       "pct_copy": None if pct is None else round(pct, 2),
                       "rel_err": round(err, 6), **extra})
        except Exception as exc:  # one failing variant must not sink the others
            sweep.add({"shape": shape, "impl": impl, "mode": mode,
                       "error": f"{type(exc).__name__}: {exc}"[:300], **extra})

    under = poisoned(TritonAttentionBackend, kv)
    default = default_segments(batch, length)
    for variant in variants:
        segs = default if variant["segments"] is None else variant["segments"]
        try:
            runs = triton_runs(under, kv, query, variant, segs, graphs=graphs)
            for mode, fn in runs:
                row("triton", mode, fn, variant=variant["name"], segments=segs)
        except Exception as exc:
            sweep.add({"shape": shape, "impl": "triton", "variant": variant["name"],
                       "error": f"{type(exc).__name__}: {exc}"[:300]})
        finally:
            _set_env(dict.fromkeys(_env(variant)))
    del under
    if flashinfer:
        try:
            from pagedcore_flashinfer import FlashInferBackend

            fi = poisoned(FlashInferBackend, kv)
            reqs = list(range(batch))
            row("flashinfer", "eager", fi.runner(kv, [1] * batch, reqs, query))
            if graphs:
                fn = fi.capture_runner(kv, reqs, query, max_seq_len=max(lens))
                if fn is not None:
                    row("flashinfer", "graph", fn)
        except Exception as exc:
            sweep.add({"shape": shape, "impl": "flashinfer",
                       "error": f"{type(exc).__name__}: {exc}"[:300]})
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="JSON file (rewritten after every row)")
    parser.add_argument("--shape", action="append", default=[], help="BATCHxCONTEXT")
    parser.add_argument("--variant", action="append", default=[])
    parser.add_argument("--heads", default="32,8,128",
                        help="HQ,HKV,D (default the bench's; 14,2,64 is Qwen2-0.5B's)")
    parser.add_argument("--flashinfer", action="store_true", help="also FlashInfer's decode")
    parser.add_argument("--no-graphs", action="store_true", help="eager rows only")
    parser.add_argument("--seconds", type=float, default=45.0,
                        help="stop timing new rows after this many seconds")
    parser.add_argument("--jobs", type=int, default=8, help="compile processes (CUDA)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--compile-only", action="store_true",
                        help="only compile the variants' kernels into Triton's cache (e.g. "
                             "ahead of `pagedcore bench kernels` on a fresh machine)")
    args = parser.parse_args(argv)
    t0 = time.time()
    global HEADS
    HEADS = parse_heads(args.heads)
    shapes = [parse_shape(s) for s in args.shape or DEFAULT_SHAPES]
    variants = [parse_variant(v) for v in args.variant or DEFAULT_VARIANTS]
    import torch

    from pagedcore.bench.kernel_primitives import copy_bandwidth_gbps
    from pagedcore.bench.report import git_commit

    device = torch.device(args.device)
    graphs = device.type == "cuda" and not args.no_graphs
    if device.type == "cuda" and args.jobs > 1:
        import multiprocessing as mp

        jobs = []
        for b, ln in shapes:
            default = default_segments(b, ln)
            for v in variants:
                jobs.append((v, b, default if v["segments"] is None else v["segments"], "cuda",
                             HEADS))
        with ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn")) as pool:
            secs = list(pool.map(compile_variant, jobs))
        print(f"compiled {len(jobs)} variants in {time.time() - t0:.1f} s "
              f"(longest {max(secs, default=0):.1f} s)", flush=True)
    if args.compile_only:
        return 0
    copy_gbps = copy_bandwidth_gbps(device, quick=False) if device.type == "cuda" else None
    sweep = Sweep(args.out, {
        "command": "python backends/triton/tools/split_sweep.py "
                   + " ".join(sys.argv[1:] if argv is None else argv),
        "git_commit": git_commit(),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "copy_bandwidth_GBps": copy_gbps,
        "heads": list(HEADS),
        "method": f"bf16, {HEADS[0]} query / {HEADS[1]} KV heads, head size {HEADS[2]}, "
                  "block size 16, blocks permuted; "
                  "each request 1-13 tokens short of the context (NaN-poisoned cache tails); "
                  "output checked finite and within 1e-2 of float32 SDPA, then timed by "
                  "pagedcore.bench.kernel_primitives.time_ms (eager) / graph_time_ms (graph); "
                  "pct_copy on the bytes read",
    })
    deadline = t0 + args.seconds
    for b, ln in shapes:
        run_shape(sweep, b, ln, variants, device=device, copy_gbps=copy_gbps,
                  flashinfer=args.flashinfer, graphs=graphs, deadline=deadline)
    sweep.info["seconds"] = round(time.time() - t0, 1)
    sweep.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
