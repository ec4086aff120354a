"""Decode sweep of the Triton kernel over an fp8 and a bf16 KV cache (one GPU; writes JSON lines).

For decode batch x context 64x4096, 8x32768 and 256x1024 (32 query / 8 KV heads, head size 128,
block size 16) and each variant (cache dtype; ``KV_CVT``, the fp8 -> dot-operand conversion;
K/V tokens per tile; warps; pipeline stages; split-KV segments) it first checks the output
against a float32 reference that reads the dequantized cache (every unused slot of the cache
NaN-poisoned, each request a few tokens short of a block boundary), then times the launch with
CUDA events (`pagedcore.bench.kernel_primitives.time_ms`, after an L2 flush) and reports the
percent of the device-to-device copy bandwidth measured in the same run, on the bytes the
cache really holds (1 per fp8 element). Kernels are compiled ahead by a pool of processes
(sharing Triton's cache) in the order they are measured.

Usage: ``python backends/triton/tools/fp8_decode_sweep.py OUT.jsonl [SECONDS [SET]]``
(SET: ``round1``, the default, or ``round2`` .. ``round4``); it stops measuring after SECONDS
(default 80) and prints a summary. ``--precompile [SET...]`` only compiles the shipped
defaults' launches (and those of the SETs); ``--best OUT.jsonl`` prints the
``PAGEDCORE_TRITON_DECODE_TILES`` value of the fastest fp8 variant when it beats the default.
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

SHAPES = [(64, 4096), (8, 32768), (256, 1024)]
HQ, HKV, D, BS = 32, 8, 128, 16
#: the split-KV segments the uniform rule gives each shape today (SplitRule defaults)
DEFAULT_SEGS = {(64, 4096): 1, (8, 32768): 8, (256, 1024): 1}

#: "cpu" only to test this script's logic under TRITON_INTERPRET=1 (tiny shapes)
DEVICE = os.environ.get("SWEEP_DEVICE", "cuda")

#: cache dtype, batch, context, KV_CVT, tile tokens, warps, stages, segments, maxnreg (0:
#: none), flags ("s": unmasked interior tiles, "o": int32 K/V offsets)
Job = tuple[str, int, int, int, int, int, int, int, int, str]
FIELDS = ["kv", "B", "L", "cvt", "tile", "warps", "stages", "segs", "maxnreg", "flags"]


def jobs_round2() -> list[Job]:
    """The second round: the shipped fp8 default against the variants that won one shape in
    the first (PTX conversion, 168 registers, 3 stages, unmasked interior tiles). (At commit
    bffc07c it also held KV_CVT 4 / 5, V read transposed: 1.2x-1.6x slower, since removed.)"""
    out: list[Job] = []
    for cvt, st, reg, fl in [(1, 5, 0, "o"), (1, 5, 0, "so"), (3, 3, 0, "o"), (3, 5, 0, "o"),
                             (1, 3, 0, "o"), (1, 3, 168, "o")]:
        for b, ln in SHAPES:
            out.append(("e4m3", b, ln, cvt, 128, 4, st, DEFAULT_SEGS[(b, ln)], reg, fl))
    for b, ln in SHAPES:
        out.append(("bf16", b, ln, 0, 64, 4, 3, DEFAULT_SEGS[(b, ln)], 0, "o"))
    return out


def jobs_round3() -> list[Job]:
    """The third round: ``kernels/decode_fp8.py`` (flags ``k1`` / ``k2`` / ``k3``: its MODE;
    ``b8``: 8 rows instead of 16) against the shipped bf16 and fp8 defaults, more split-KV
    segments at 8x32768, and the sink logits' cost (flag ``x``) on the bf16 default and the
    new kernel."""
    out: list[Job] = []

    def add(dt: str, cvt: int, tile: int, w: int, st: int, fl: str,
            segs: dict[tuple[int, int], list[int]] | None = None) -> None:
        for b, ln in SHAPES:
            for sg in (segs or {}).get((b, ln), [DEFAULT_SEGS[(b, ln)]]):
                j = (dt, b, ln, cvt, tile, w, st, sg, 0, fl)
                if j not in out:
                    out.append(j)

    add("bf16", 0, 64, 4, 3, "o")
    add("e4m3", 1, 128, 4, 5, "o")
    add("bf16", 0, 64, 4, 3, "ox")
    # (tile, warps, stages, maxnreg, flags); b8: 8 rows; registers bound the CTAs per SM
    for tile, w, st, reg, fl in [
            (64, 4, 3, 0, "k3o"), (64, 4, 3, 0, "k3ob8"), (64, 8, 3, 0, "k3o"),
            (32, 4, 3, 0, "k3o"), (128, 8, 3, 0, "k3o"), (64, 4, 3, 128, "k3ob8"),
            (128, 4, 3, 0, "k3o"), (64, 4, 3, 0, "k1ob8"), (128, 8, 3, 0, "k1o"),
            (128, 8, 3, 0, "k1ob8"), (64, 4, 4, 0, "k3ob8"), (64, 4, 2, 0, "k3ob8"),
            (32, 4, 4, 0, "k3o"), (128, 8, 4, 0, "k3ob8"), (64, 8, 4, 0, "k3o"),
            (32, 8, 3, 0, "k3o")]:
        for b, ln in SHAPES:
            j = ("e4m3", b, ln, 0, tile, w, st, DEFAULT_SEGS[(b, ln)], reg, fl)
            if j not in out:
                out.append(j)
    more = {(64, 4096): [2], (8, 32768): [16, 32], (256, 1024): []}
    for tile, w, st, fl in [(64, 4, 3, "k3ob8"), (128, 8, 3, "k3o"), (32, 4, 3, "k3o")]:
        add("e4m3", 0, tile, w, st, fl, more)
    add("e4m3", 0, 64, 4, 3, "k3ob8x")
    add("e4m3", 0, 64, 8, 2, "k2o")
    add("e5m2", 0, 64, 4, 3, "k3o")
    add("e4m3", 1, 128, 4, 1, "o")  # general kernel, V converted in registers, unpipelined
    return out


def jobs_round4() -> list[Job]:
    """The fourth round: round 3 found every ``kernels/decode_fp8.py`` variant slower than the
    shipped fp8 default, about 3.3 us per tile whatever its size: the block-table load, then
    the K/V loads, waited for in every iteration (V reaches the registers by plain loads,
    which Triton does not pipeline). Here the kernel prefetches them itself (flags ``p1``:
    K/V one tile ahead, ``p2``: also the block table two ahead; 1 stage), and Triton's
    5-stage pipelining is tried on it, against the shipped defaults and round 1's unmasked
    interior tiles."""
    out: list[Job] = []

    def add(dt: str, cvt: int, tile: int, w: int, st: int, fl: str) -> None:
        for b, ln in SHAPES:
            j = (dt, b, ln, cvt, tile, w, st, DEFAULT_SEGS[(b, ln)], 0, fl)
            if j not in out:
                out.append(j)

    add("bf16", 0, 64, 4, 3, "o")
    add("e4m3", 1, 128, 4, 5, "o")
    for tile, w, st, fl in [(64, 4, 1, "k3ob8p2"), (64, 4, 1, "k3op2"), (128, 8, 1, "k3op2"),
                            (128, 8, 1, "k1ob8p2"), (32, 4, 1, "k3op2"), (64, 8, 1, "k3ob8p2"),
                            (128, 8, 1, "k3ob8p2"), (32, 4, 1, "k3ob8p2"), (64, 4, 1, "k3ob8p1"),
                            (64, 8, 1, "k3op2"), (64, 4, 1, "k1ob8p2"), (128, 4, 5, "k3o")]:
        add("e4m3", 0, tile, w, st, fl)
    add("e4m3", 1, 128, 4, 5, "so")
    return out


JOB_SETS = {"round1": lambda: jobs(), "round2": lambda: jobs_round2(),
            "round3": lambda: jobs_round3(), "round4": lambda: jobs_round4()}


def tiles_env(row: dict[str, Any]) -> str:
    """The ``PAGEDCORE_TRITON_DECODE_TILES`` value of a sweep row's variant."""
    fl = row["flags"]
    parts = [str(row["tile"]), str(row["warps"]), str(row["stages"]), f"cvt{row['cvt']}"]
    if "k" in fl:
        parts.append(f"k{fl[fl.index('k') + 1]}")
    if "b8" in fl:
        parts.append("b8")
    if "p" in fl:
        parts.append(f"pf{fl[fl.index('p') + 1]}")
    if "s" in fl:
        parts.append("s")
    if "o" in fl:
        parts.append("i32")
    if row.get("maxnreg"):
        parts.append(f"r{row['maxnreg']}")
    return ",".join(parts)


def best_variant(path: str, dt: str = "e4m3") -> None:
    """Print the ``PAGEDCORE_TRITON_DECODE_TILES`` value of the fastest `dt` variant of a
    sweep file (geometric mean over the shapes it was measured at with each shape's default
    split, correct ones only), or nothing when none beats the first (the shipped default)."""
    rows = [json.loads(line) for line in open(path)][1:]
    ok = [r for r in rows if r["kv"] == dt and "ms" in r and not r["nan"] and r["rel_err"] < 0.05
          and r["segs"] == DEFAULT_SEGS.get((r["B"], r["L"]))]
    by: dict[str, dict[tuple[int, int], float]] = {}
    for r in ok:
        by.setdefault(tiles_env(r), {})[(r["B"], r["L"])] = r["ms"]
    full = {k: v for k, v in by.items() if len(v) == len(SHAPES)}
    if not full:
        return
    default = next(iter(full))

    def gmean(v: dict[tuple[int, int], float]) -> float:
        prod = 1.0
        for x in v.values():
            prod *= x
        return float(prod ** (1 / len(v)))

    best = min(full, key=lambda k: gmean(full[k]))
    if best != default and gmean(full[best]) < 0.97 * gmean(full[default]):
        print(best)


def jobs() -> list[Job]:
    """Every variant of the first round, most important first."""
    out: list[Job] = []

    def add(dt: str, cvt: int, tile: int, w: int, st: int,
            segs: dict[tuple[int, int], list[int]] | None = None, maxnreg: int = 0,
            flags: str = "") -> None:
        for b, ln in SHAPES:
            for s in (segs or {}).get((b, ln), [DEFAULT_SEGS[(b, ln)]]):
                j = (dt, b, ln, cvt, tile, w, st, s, maxnreg, flags)
                if j not in out:
                    out.append(j)

    add("bf16", 0, 64, 4, 3)  # today's bf16 default
    add("e4m3", 0, 128, 4, 3)  # today's fp8 default
    for tile, w, st in [(128, 4, 3), (128, 4, 5), (128, 4, 4), (128, 4, 6), (128, 8, 2),
                        (128, 8, 3), (128, 8, 5), (64, 4, 3), (64, 4, 5), (64, 8, 3),
                        (64, 8, 5), (64, 8, 6), (256, 8, 3)]:
        add("e4m3", 1, tile, w, st)
    for tile, w, st, reg, fl in [(128, 4, 5, 0, "so"), (128, 4, 3, 0, "so"), (128, 4, 5, 0, "o"),
                                 (64, 8, 5, 0, "so"), (128, 8, 5, 128, "so"),
                                 (128, 4, 3, 168, ""), (128, 4, 5, 168, ""),
                                 (128, 4, 5, 168, "so"), (64, 4, 5, 168, ""),
                                 (128, 8, 5, 128, "")]:
        add("e4m3", 1, tile, w, st, maxnreg=reg, flags=fl)
    for tile, w, st in [(128, 4, 3), (128, 4, 5)]:
        add("e4m3", 3, tile, w, st)
    more = {(64, 4096): [1, 2, 4], (8, 32768): [4, 8, 16, 32], (256, 1024): [1, 2]}
    for tile, w, st, fl in [(128, 4, 3, ""), (128, 4, 5, ""), (64, 4, 5, ""), (128, 8, 3, ""),
                            (128, 4, 5, "so")]:
        add("e4m3", 1, tile, w, st, more, flags=fl)
    for cvt, tile, w, st, fl in [(1, 128, 4, 3, ""), (1, 128, 4, 5, ""), (1, 64, 4, 5, ""),
                                 (0, 128, 4, 3, ""), (2, 128, 4, 3, ""), (3, 128, 4, 3, ""),
                                 (1, 128, 4, 5, "so")]:
        add("e5m2", cvt, tile, w, st, flags=fl)
    bsegs = {(8, 32768): [4, 8, 16, 32]}
    for tile, w, st, fl in [(64, 4, 3, ""), (64, 4, 3, "o"), (64, 4, 3, "so"), (64, 4, 5, ""),
                            (64, 4, 5, "o"), (64, 4, 4, ""), (64, 4, 2, ""), (64, 8, 3, ""),
                            (64, 8, 5, ""), (128, 4, 3, ""), (128, 4, 5, ""), (128, 8, 3, ""),
                            (32, 4, 3, "")]:
        add("bf16", 0, tile, w, st, bsegs, flags=fl)
    return out


def default_jobs() -> list[Job]:
    """The launches the shipped defaults make at each shape and cache dtype (`tile_config`
    and the builder's split rule), for ``--precompile``."""
    import torch
    from pagedcore_triton.metadata import TritonMetadataBuilder
    from pagedcore_triton.plan import tile_config

    from pagedcore.kv_cache.spec import FullAttentionSpec

    out: list[Job] = []
    for dt in ("e4m3", "bf16", "e5m2"):
        item = 2 if dt == "bf16" else 1
        cfg = tile_config(1, HQ // HKV, D, interpreting=False, itemsize=2, kv_itemsize=item)
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=HKV, head_size=D,
                                 dtype="bfloat16" if dt == "bf16" else _TORCH_DT[dt])
        builder = TritonMetadataBuilder(spec, ["sweep"], torch.device("cpu"))
        for b, ln in SHAPES:
            segs = builder.decode_segments(num_reqs=b, max_seq_len=ln)
            flags = ("s" if cfg.skip_interior_masks else "") + ("o" if cfg.int32_offsets else "")
            if dt != "bf16" and cfg.fp8_decode:
                flags += f"k{cfg.fp8_decode}" + ("b8" if cfg.fp8_rows == 8 else "")
                flags += f"p{cfg.fp8_prefetch}" if cfg.fp8_prefetch else ""
            job = (dt, b, ln, cfg.kv_convert, cfg.tile_n, cfg.num_warps, cfg.num_stages,
                   segs, cfg.maxnreg or 0, flags)
            out.append(job)
            if dt == "bf16":  # `bench kernels --sinks` compares these with the plain ones
                out.append((*job[:-1], flags + "x"))
    return out


def _sinks(dev: Any) -> Any:
    """The sink logits of the ``x`` variants (fixed: the reference uses the same)."""
    import torch

    return (torch.arange(HQ, dtype=torch.float32, device=dev) % 5 - 2.0) * 1.5


_TORCH_DT = {"bf16": "bfloat16", "e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}


def _launch(job: Job, kv: Any, query: Any, seq_lens: Any) -> tuple[Any, Any]:
    """A prepared launch of `job` over the cache `kv` and a runner of it."""
    import torch
    from pagedcore_triton.ops import prepare_launch, run_launch
    from pagedcore_triton.plan import LaunchPart, TileConfig

    dt, b, _, cvt, tile, w, st, segs, maxnreg, flags = job
    cache, table, qsl, scales = kv
    part = LaunchPart(req_begin=0, req_end=b, token_begin=0, token_end=b, max_query_len=1,
                      num_segments=segs)
    mode = int(flags[flags.index("k") + 1]) if "k" in flags else 0
    tiles = TileConfig(block_m=16, block_q=4, tile_n=tile, num_warps=w, num_stages=st,
                       kv_convert=cvt, maxnreg=maxnreg or None,
                       skip_interior_masks="s" in flags, int32_offsets="o" in flags,
                       fp8_decode=mode, fp8_rows=8 if "b8" in flags else 16,
                       fp8_prefetch=int(flags[flags.index("p") + 1]) if "p" in flags else 0)
    sinks = _sinks(query.device) if "x" in flags else None
    launch = prepare_launch(
        part, query_shape=tuple(query.shape), dtype=query.dtype,
        kv_cache_shape=tuple(cache.shape), query_start_loc=qsl, seq_lens=seq_lens,
        block_table=table, causal=True, use_alibi=False, sliding_window=None,
        logits_soft_cap=None, tiles=tiles, kv_fp8=dt != "bf16", use_sinks=sinks is not None,
    )
    if mode and launch.kernel != "fp8_decode":
        raise RuntimeError(f"{job}: not routed to the fp8 decode kernel")
    out = torch.empty_like(query)

    def run() -> Any:
        run_launch(launch, query, cache, out, scale=D**-0.5, alibi_slopes=None,
                   sliding_window=None, logits_soft_cap=None,
                   kv_scales=scales if dt != "bf16" else None, sinks=sinks)
        return out

    return launch, run


def _tiny_cache(dt: str, b: int) -> tuple[Any, Any, Any]:
    """Caches with the real launches' specialization (batch, strides divisible by 16)."""
    import torch

    dev = torch.device(DEVICE)
    ln = 256
    cache = torch.zeros((2, 1 + b * ln // BS, BS, HKV, D), dtype=torch.bfloat16, device=dev)
    cache = cache.to(getattr(torch, _TORCH_DT[dt]))
    table = (torch.arange(b * ln // BS, dtype=torch.int32, device=dev) + 1).view(b, -1)
    qsl = torch.arange(b + 1, dtype=torch.int32, device=dev)
    scales = (torch.ones(1, device=dev), torch.ones(1, device=dev))
    seq = torch.full((b,), ln, dtype=torch.int32, device=dev)
    return (cache, table, qsl, scales), seq, torch.zeros((b, HQ, D), dtype=torch.bfloat16,
                                                          device=dev)


def compile_job(job: Job) -> float:
    """Compile (by running once on a tiny cache) one variant; seconds taken."""
    import torch

    t0 = time.perf_counter()
    kv, seq, q = _tiny_cache(job[0], job[1])
    _launch(job, kv, q, seq)[1]()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def compile_write(dt: str) -> float:
    """Compile the backend's cache write for `dt` (a tiny `BackendUnderTest`, as the kernel
    bench builds its caches); seconds taken."""
    import torch
    from pagedcore_triton import TritonAttentionBackend

    from pagedcore.bench.kernel_primitives import BackendUnderTest, PagedKV

    t0 = time.perf_counter()
    kv = PagedKV([64] * 4, torch.bfloat16, torch.device(DEVICE))
    BackendUnderTest(TritonAttentionBackend, kv, kv_cache_dtype="auto" if dt == "bf16" else "fp8")
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def build_cache(dt: str, b: int, ln: int, gen: Any) -> dict[str, Any]:
    """The shape's cache (random block order, unused slots NaN), query and reference."""
    import torch

    dev = torch.device(DEVICE)
    nb = b * ln // BS
    perm = torch.randperm(nb, generator=gen).to(dev) + 1
    table = perm.view(b, ln // BS).to(torch.int32).contiguous()
    key = torch.randn((b, ln, HKV, D), device=dev, dtype=torch.bfloat16)
    val = torch.randn((b, ln, HKV, D), device=dev, dtype=torch.bfloat16)
    # correctness: each request 1..15 tokens short of its last block; those slots stay NaN
    short = torch.randint(1, BS, (b,), generator=gen)
    lens_c = (ln - short).to(torch.int32).to(dev)
    tdt = getattr(torch, _TORCH_DT[dt])
    cache = torch.empty((2, nb + 1, BS, HKV, D), dtype=tdt, device=dev)
    if dt == "bf16":
        cache.fill_(float("nan"))
        ks = vs = torch.ones(1, device=dev)
        kq, vq = key, val
    else:
        cache.view(torch.uint8).fill_(0x7F)  # NaN in e4m3fn and e5m2
        fmax = 448.0 if dt == "e4m3" else 57344.0
        ks = (key.abs().amax().float() / fmax).reshape(1)
        vs = (val.abs().amax().float() / fmax).reshape(1)
        kq = (key.float() / ks).clamp(-fmax, fmax).to(tdt)
        vq = (val.float() / vs).clamp(-fmax, fmax).to(tdt)
    pos = torch.arange(ln, device=dev)
    valid = pos[None, :] < lens_c[:, None].long()  # [b, ln]
    slots = (table.long()[:, pos // BS] * BS + pos % BS)  # [b, ln]
    raw = torch.uint8 if cache.element_size() == 1 else torch.int16  # index_put on raw bits
    flat_k = cache[0].view(raw).view(-1, HKV, D)
    flat_v = cache[1].view(raw).view(-1, HKV, D)
    flat_k[slots[valid]] = kq.view(raw)[valid]
    flat_v[slots[valid]] = vq.view(raw)[valid]
    query = torch.randn((b, HQ, D), device=dev, dtype=torch.bfloat16)
    # reference in float32 over exactly what the kernel reads (dequantized fp8)
    kd = kq.float() * ks
    vd = vq.float() * vs
    q4 = query.float().view(b, HKV, HQ // HKV, D)
    s = torch.einsum("bhgd,blhd->bhgl", q4, kd) * D**-0.5
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    ref = torch.einsum("bhgl,blhd->bhgd", s.softmax(-1), vd).reshape(b, HQ, D)
    # with sink logits: one more score per row, in the denominator only
    sk = _sinks(dev).view(1, HKV, HQ // HKV, 1).expand(b, -1, -1, 1)
    w = torch.cat([s, sk], -1).softmax(-1)[..., :-1]
    ref_sink = torch.einsum("bhgl,blhd->bhgd", w, vd).reshape(b, HQ, D)
    del kd, vd, s, w, key, val, kq, vq
    qsl = torch.arange(b + 1, dtype=torch.int32, device=dev)
    return {"kv": (cache, table, qsl, (ks, vs)), "query": query, "ref": ref,
            "ref_sink": ref_sink,
            "lens_c": lens_c, "lens_t": torch.full((b,), ln, dtype=torch.int32, device=dev),
            "bytes": 2 * b * ln * HKV * D * cache.element_size()}


def precompile(sets: list[str]) -> None:
    """Compile the shipped defaults' decode launches, then those of the job `sets`, in parallel
    (warms Triton's cache for ``pagedcore bench kernels`` and a later sweep); prints the
    seconds each took."""
    import multiprocessing as mp

    todo = default_jobs()
    for name in sets:
        todo += [j for j in JOB_SETS[name]() if j not in todo]
    workers = max(1, min(12, (os.cpu_count() or 4) - 4))
    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
        writes = [pool.submit(compile_write, dt) for dt in ("e4m3", "bf16")]
        for job, secs in zip(todo, pool.map(compile_job, todo), strict=True):
            print("precompiled", job, f"{secs:.1f}s", flush=True)
        for dt, fut in zip(("e4m3", "bf16"), writes, strict=True):
            print("precompiled the cache write", dt, f"{fut.result():.1f}s", flush=True)


def main() -> None:
    if sys.argv[1] == "--precompile":
        precompile(sys.argv[2:])
        return
    if sys.argv[1] == "--best":
        best_variant(sys.argv[2])
        return
    out_path = sys.argv[1]
    budget = float(sys.argv[2]) if len(sys.argv) > 2 else 80.0
    job_set = sys.argv[3] if len(sys.argv) > 3 else "round1"
    t_start = time.perf_counter()
    import multiprocessing as mp

    import torch

    from pagedcore.bench.kernel_primitives import copy_bandwidth_gbps, time_ms

    todo = JOB_SETS[job_set]()
    ctx = mp.get_context("spawn")
    workers = max(1, min(12, (os.cpu_count() or 4) - 4))
    # SWEEP_POOL=0: no compile pool (the kernels are in Triton's cache already: --precompile)
    pool = None if os.environ.get("SWEEP_POOL") == "0" else ProcessPoolExecutor(
        max_workers=workers, mp_context=ctx)
    futures: list[Future[float] | None] = [
        None if pool is None else pool.submit(compile_job, j) for j in todo]
    dev = torch.device(DEVICE)
    copy = copy_bandwidth_gbps(dev, quick=False)
    rows: list[dict[str, Any]] = []
    with open(out_path, "w") as fh:
        name = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
        fh.write(json.dumps({"copy_bandwidth_GBps": copy, "device": name,
                             "torch": torch.__version__, "jobs": len(todo)}) + "\n")
        import pagedcore_triton

        print(f"copy {copy:.0f} GB/s; {len(todo)} variants; {pagedcore_triton.__file__}",
              flush=True)
        gen = torch.Generator().manual_seed(0)
        caches: dict[tuple[str, int, int], dict[str, Any]] = {}
        for job, fut in zip(todo, futures, strict=True):
            if time.perf_counter() - t_start > budget:
                print(f"time budget reached; {len(rows)} of {len(todo)} measured", flush=True)
                break
            dt, b, ln = job[:3]
            key = (dt, b, ln)
            if key not in caches:  # all kept: ~6 GB for the three shapes and dtypes
                caches[key] = build_cache(dt, b, ln, gen)
            c = caches[key]
            row: dict[str, Any] = dict(zip(FIELDS, job, strict=True))
            try:
                try:
                    if fut is not None:
                        wait = max(1.0, budget - (time.perf_counter() - t_start))
                        row["compile_s"] = round(fut.result(timeout=wait), 2)
                except Exception as exc:  # a broken pool: compile here instead
                    row["pool_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                _, run_c = _launch(job, c["kv"], c["query"], c["lens_c"])
                got = run_c().float()
                ref = c["ref_sink"] if "x" in job[-1] else c["ref"]
                row["rel_err"] = float((got - ref).norm() / ref.norm())
                row["nan"] = bool(torch.isnan(got).any())
                _, run_t = _launch(job, c["kv"], c["query"], c["lens_t"])
                ms = time_ms(run_t, dev, budget_ms=5.0)
                row["ms"] = ms
                row["pct_copy"] = 100 * c["bytes"] / ms / 1e6 / copy
            except Exception as exc:  # one failing variant must not sink the sweep
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            rows.append(row)
            fh.write(json.dumps(row) + "\n")
            fh.flush()
    if pool is not None:
        pool.shutdown(wait=False, cancel_futures=True)
    summarize(rows)
    print(f"elapsed {time.perf_counter() - t_start:.1f} s", flush=True)


def summarize(rows: list[dict[str, Any]]) -> None:
    """Best variant per (cache dtype, shape), and fp8's speed-up over bf16's best and default."""
    ok = [r for r in rows if "ms" in r and not r.get("nan") and r["rel_err"] < 0.05]
    for b, ln in SHAPES:
        base = [r for r in ok if r["kv"] == "bf16" and (r["B"], r["L"]) == (b, ln)]
        bf_default = base[0]["ms"] if base else None
        bf_best = min((r["ms"] for r in base), default=None)
        for dt in ("bf16", "e4m3", "e5m2"):
            mine = [r for r in ok if r["kv"] == dt and (r["B"], r["L"]) == (b, ln)]
            if not mine:
                continue
            best = min(mine, key=lambda r: r["ms"])
            first = mine[0]
            ratio = f" {bf_best / best['ms']:.2f}x bf16-best" if bf_best else ""
            ratio += f" {bf_default / best['ms']:.2f}x bf16-default" if bf_default else ""
            print(f"{b}x{ln} {dt}: default {first['ms']*1e3:.1f}us ({first['pct_copy']:.0f}%) "
                  f"best {best['ms']*1e3:.1f}us ({best['pct_copy']:.0f}%) cvt{best['cvt']} "
                  f"t{best['tile']} w{best['warps']} st{best['stages']} s{best['segs']} "
                  f"r{best['maxnreg']} {best['flags'] or '-'} "
                  f"err {best['rel_err']:.1e}{ratio}", flush=True)
    bad = [r for r in rows if "error" in r or r.get("nan") or r.get("rel_err", 0) >= 0.05]
    for r in bad[:8]:
        print("BAD", json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
