"""The Hopper prefill kernel on the GPU: correctness, then timing of its tile variants.

Usage::

    python backends/triton/tools/tma_variants.py OUT [--small] [--budget S] [VARIANT...]

A VARIANT is a ``PAGEDCORE_TRITON_TMA_TILES`` value (``default`` = `tma_tile_config`'s), see
`pagedcore_triton.plan_tma.parse_tma_tiles`. In order, each step writing its JSON as it goes
and skipped once ``--budget`` seconds (default 115) have passed:

1. ``check.json``: a ragged batch (prefills, chunks continuing a cached prefix, decodes, 3
   padding tokens whose query/key/value rows are NaN) on a NaN-poisoned, randomly permuted
   cache against the float64 formula of the tests: bf16 for the first three variants (the
   others are checked against SDPA at the timing shapes), fp16 and a layer
   with window + soft-cap + ALiBi (must fall back to the gather kernel) for the default;
   whether the Hopper kernel ran is recorded per check.
2. ``time.json``: causal 4x2048 and 4x8192 (bf16, 32 q / 8 KV heads, d 128, block 16) with
   `pagedcore.bench.kernels` timing: torch SDPA on contiguous K/V (re-timed after every two
   variants), the gather kernel (not with ``TMA_NO_GATHER=1``), then every variant (both
   shapes after each other).
3. ``mixed.json``: `pagedcore.bench.kernels.bench_mixed` (64 decodes @4096 + a 2048-token
   chunk @2048) with the Hopper kernel and with the gather kernel.
4. ``conformance.json``: the conformance suite's prefill cases (``prefill`` in the name) on
   the default.

``--warm VARIANT [CHECK_JSON]`` only compiles `VARIANT` (or ``gather``) for the timing shapes
(then, with `CHECK_JSON`, runs step 1's bf16 check of `VARIANT` into that file, with
``--fresh-only`` on the prefix-free batch only), and
``--warm-mixed`` the mixed step's launches, so that several processes started beside the
main one (or before ``pagedcore bench kernels``) fill Triton's on-disk cache in parallel.

``--small`` shrinks every shape for a logic check on CPU (``TRITON_INTERPRET=1`` and
``PAGEDCORE_TRITON_PREFILL_KERNEL=tma``). ``--steps check,time,...`` runs only the steps
named (default: all four), ``--checks N`` checks the first N variants (default 3).

``--best OUT`` prints the variant of ``OUT/time.json`` with the highest geometric mean of its
ratios to SDPA at the two shapes (``default`` when none was timed or none beats it by 2%),
for a job to run the conformance suite on it next.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

from prefill_variants import _Out, _prefill_case  # noqa: E402  (tools/ is not a package)

TILES = "PAGEDCORE_TRITON_TMA_TILES"
#: (context, query), decode-first as the engine orders a step: decodes, prefills, chunks.
RAGGED = [(35, 1), (4000, 1), (0, 300), (517, 211), (1000, 77), (0, 64), (130, 1000), (7, 33)]
RAGGED_SMALL = [(3, 1), (0, 21), (17, 9), (40, 16)]
#: Prefills without a cached prefix only (the launch a ``wsk`` variant serves itself).
FRESH = [(0, 300), (0, 64), (0, 1000), (0, 33), (0, 517), (0, 129)]
FRESH_SMALL = [(0, 21), (0, 9), (0, 40)]
T0 = time.time()


def _select(variant: str) -> None:
    if variant == "default":
        os.environ.pop(TILES, None)
    else:
        os.environ[TILES] = variant


def _check(variant: str, dtype: torch.dtype, small: bool, features: bool,
           fresh: bool = False) -> dict[str, Any]:
    from _reference import make_batch, reference_attention, rel_error
    from pagedcore_triton import TritonAttentionBackend

    from pagedcore.kv_cache.spec import FullAttentionSpec

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    heads, kv_heads, head_size = (8, 2, 64) if small else (32, 8, 128)
    reqs = (FRESH_SMALL if small else FRESH) if fresh else (RAGGED_SMALL if small else RAGGED)
    batch = make_batch(reqs, num_heads=heads,
                       num_kv_heads=kv_heads, head_size=head_size, block_size=16,
                       dtype=dtype, device=dev, num_padding=3, seed=7)
    n = batch.common.num_actual_tokens
    for t in (batch.query, batch.key, batch.value):
        t[n:] = float("nan")
    spec = FullAttentionSpec(block_size=16, num_kv_heads=kv_heads, head_size=head_size,
                             dtype=dtype)
    builder = TritonAttentionBackend.get_builder_cls()(spec, ["l0"], torch.device(dev))
    metadata = builder.build(batch.common)
    scale = head_size**-0.5
    extra: dict[str, Any] = {}
    if features:
        extra = {"sliding_window": 200, "logits_soft_cap": 30.0,
                 "alibi_slopes": [2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)]}
    impl = TritonAttentionBackend.get_impl_cls()(heads, head_size, scale,
                                                 num_kv_heads=kv_heads, **extra)
    impl.do_kv_cache_update(batch.key, batch.value, batch.kv_cache, batch.common.slot_mapping)
    out = torch.full_like(batch.query, float("nan"))
    impl.forward(batch.query, batch.key, batch.value, batch.kv_cache, metadata, output=out)
    ref = reference_attention(batch, scale=scale, **{k: v for k, v in extra.items()})
    err = rel_error(out[:n], ref)
    tol = {torch.bfloat16: 2e-2, torch.float16: 3e-3}.get(dtype, 1e-4)
    finite = bool(torch.isfinite(out[:n]).all())
    return {"variant": variant, "dtype": str(dtype), "features": features, "fresh": fresh,
            "rel_err": err,
            "tol": tol, "finite": finite, "ok": bool(err < tol and finite),
            "tma_ran": any(k[0] == "tma" for k in metadata.launches)}


def step_check(out_dir: Path, variants: list[str], small: bool) -> None:
    out = _Out(out_dir / "check.json")
    dtype = torch.float32 if small else torch.bfloat16
    cases = [(v, dtype, False) for v in variants]
    if not small:
        cases += [("default", torch.float16, False)]
    cases += [("default", dtype, True)]
    for variant, dt, features in cases:
        _select(variant)
        try:
            out.add(_check(variant, dt, small, features))
        except Exception as exc:
            out.add({"variant": variant, "dtype": str(dt), "features": features, "ok": False,
                     "error": f"{type(exc).__name__}: {str(exc)[:600]}"})
    _select("default")


def step_time(out_dir: Path, variants: list[str], small: bool, budget: float) -> None:
    """Both shapes per variant (one compile serves both), SDPA re-timed every two."""
    from pagedcore_triton import TritonAttentionBackend

    from pagedcore.bench import kernels as k

    out = _Out(out_dir / "time.json")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cases = []
    for batch, length in [(1, 48), (2, 40)] if small else [(4, 2048), (4, 8192)]:
        kv, query, sdpa, ref, flops = _prefill_case(batch, length)
        under = k.BackendUnderTest(TritonAttentionBackend, kv)
        cases.append((f"{batch}x{length}", batch, length, kv, query, sdpa, ref, flops, under))
    last: dict[str, float] = {}

    def time_sdpa() -> None:
        for shape, _, _, _, _, sdpa, _, flops, _ in cases:
            last[shape] = k.time_ms(sdpa, dev, budget_ms=150)
            out.add({"shape": shape, "impl": "sdpa", "ms": last[shape],
                     "TFLOPs": flops / last[shape] / 1e9})

    time_sdpa()
    first = [] if os.environ.get("TMA_NO_GATHER") else ["gather"]
    for i, variant in enumerate([*first, *variants]):
        if time.time() - T0 > budget:
            out.add({"variant": variant, "skipped": "over budget"})
            continue
        _select("default" if variant == "gather" else variant)
        for shape, batch, length, kv, query, _, ref, flops, under in cases:
            under.builder.tma_prefill = variant != "gather"  # type: ignore[attr-defined]
            try:
                run = under.runner(kv, [length] * batch, list(range(batch)), query)
                err = k._rel(run(), ref)
                ms = k.time_ms(run, dev, budget_ms=150)
                out.add({"shape": shape, "impl": "triton", "variant": variant, "ms": ms,
                         "TFLOPs": flops / ms / 1e9, "vs_sdpa_last": last[shape] / ms,
                         "rel_err_vs_sdpa": err})
            except Exception as exc:
                out.add({"shape": shape, "variant": variant,
                         "error": f"{type(exc).__name__}: {str(exc)[:600]}"})
        if i % 2 == 1:
            time_sdpa()
    time_sdpa()
    _select("default")
    cases.clear()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def step_mixed(out_dir: Path, small: bool) -> None:
    from pagedcore_triton import TritonAttentionBackend

    from pagedcore.bench import kernels as k

    out = _Out(out_dir / "mixed.json")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = (4, 64, 16, 16) if small else (64, 4096, 2048, 2048)
    for kernel in ("tma", "gather"):
        os.environ["PAGEDCORE_TRITON_PREFILL_KERNEL"] = kernel
        try:
            for row in k.bench_mixed(*shape, [TritonAttentionBackend], dev):
                out.add({"kernel": kernel, **row})
        except Exception as exc:
            out.add({"kernel": kernel, "error": f"{type(exc).__name__}: {str(exc)[:600]}"})
    os.environ.pop("PAGEDCORE_TRITON_PREFILL_KERNEL", None)


def step_conformance(out_dir: Path) -> None:
    from pagedcore.conformance import run_suite

    out = _Out(out_dir / "conformance.json")
    dev = "cuda" if torch.cuda.is_available() else "cpu"

    def add(r: Any) -> None:
        out.add({"case": r.name, "passed": r.passed, "rel_err": r.max_rel_error,
                 "s": r.seconds, "message": r.message, "skipped": r.skipped})

    report = run_suite("triton", device=dev, case_filter="prefill", on_result=add)
    out.add({"summary": report.summary().splitlines()[-1], "passed": report.passed})


def warm(variant: str, small: bool) -> None:
    """Compile `variant` at the timing step's specialization (fills Triton's cache)."""
    from pagedcore_triton import TritonAttentionBackend

    from pagedcore.bench import kernels as k

    _select("default" if variant == "gather" else variant)
    batch, length = (1, 48) if small else (4, 2048)
    kv, query, _, ref, _ = _prefill_case(batch, length)
    under = k.BackendUnderTest(TritonAttentionBackend, kv)
    under.builder.tma_prefill = variant != "gather"  # type: ignore[attr-defined]
    err = k._rel(under.runner(kv, [length] * batch, list(range(batch)), query)(), ref)
    print(f"warm {variant}: rel_err {err:.3g} at {time.time() - T0:.1f}s", flush=True)


def warm_mixed(small: bool) -> None:
    """Compile what `pagedcore.bench.kernels.bench_mixed` runs (the step and its two parts)."""
    from pagedcore_triton import TritonAttentionBackend

    from pagedcore.bench import kernels as k

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    decodes, ctx, chunk, prefix = (4, 64, 16, 16) if small else (64, 4096, 2048, 2048)
    kv = k.PagedKV([ctx] * decodes + [prefix + chunk], dtype, dev)
    q_lens = [1] * decodes + [chunk]
    query = torch.randn((sum(q_lens), k.NUM_HEADS, k.HEAD_SIZE), dtype=dtype, device=dev)
    under = k.BackendUnderTest(TritonAttentionBackend, kv)
    under.runner(kv, q_lens, list(range(decodes + 1)), query)()
    under.runner(kv, [1] * decodes, list(range(decodes)), query[:decodes])()
    under.runner(kv, [chunk], [decodes], query[decodes:])()
    print(f"warm mixed at {time.time() - T0:.1f}s", flush=True)


def best(out_dir: Path) -> str:
    """The timed variant with the highest geometric mean of its ratios to SDPA."""
    import json

    ratios: dict[str, list[float]] = {}
    path = out_dir / "time.json"
    rows = json.loads(path.read_text())["rows"] if path.exists() else []
    for row in rows:
        if row.get("impl") == "triton" and row.get("variant") not in (None, "gather"):
            if row.get("rel_err_vs_sdpa", 1.0) < 2e-2:
                ratios.setdefault(row["variant"], []).append(row["vs_sdpa_last"])
    timed = {v: (r[0] * r[1]) ** 0.5 for v, r in ratios.items() if len(r) == 2}
    if not timed:
        return "default"
    top = max(timed, key=lambda v: timed[v])
    # A variant replaces the default only by more than the run-to-run spread (~1-2%).
    if "default" in timed and timed[top] < 1.02 * timed["default"]:
        return "default"
    return top


def _opt(args: list[str], name: str, default: str) -> str:
    if name not in args:
        return default
    i = args.index(name)
    value = args[i + 1]
    del args[i : i + 2]
    return value


def main() -> None:
    args = sys.argv[1:]
    if args and args[0] == "--best":
        print(best(Path(args[1])))
        return
    small = "--small" in args
    if args and args[0] == "--warm":
        warm(args[1], small)
        if len(args) > 2 and not args[2].startswith("--"):
            out = _Out(Path(args[2]))
            dtype = torch.float32 if small else torch.bfloat16
            for fresh in (True,) if "--fresh-only" in args else (False, True):
                try:
                    out.add(_check(args[1], dtype, small, False, fresh))
                except Exception as exc:
                    out.add({"variant": args[1], "dtype": str(dtype), "ok": False,
                             "fresh": fresh,
                             "error": f"{type(exc).__name__}: {str(exc)[:600]}"})
        return
    if args and args[0] == "--warm-mixed":
        warm_mixed(small)
        return
    budget = float(_opt(args, "--budget", "115"))
    steps = _opt(args, "--steps", "check,time,mixed,conformance").split(",")
    checks = int(_opt(args, "--checks", "3"))
    args = [a for a in args if a != "--small"]
    if not args:
        raise SystemExit(__doc__)
    out_dir = Path(args[0])
    out_dir.mkdir(parents=True, exist_ok=True)
    variants = args[1:] or ["default"]
    torch.manual_seed(0)
    if "check" in steps:
        step_check(out_dir, variants[:checks], small)
        print(f"== check done at {time.time() - T0:.1f}s", flush=True)
    if "time" in steps:
        step_time(out_dir, variants, small, budget - 30 if "mixed" in steps else budget)
        print(f"== time done at {time.time() - T0:.1f}s", flush=True)
    if "mixed" in steps and time.time() - T0 < budget - 25:
        step_mixed(out_dir, small)
        print(f"== mixed done at {time.time() - T0:.1f}s", flush=True)
    if "conformance" in steps and time.time() - T0 < budget - 15:
        step_conformance(out_dir)
        print(f"== conformance done at {time.time() - T0:.1f}s", flush=True)


if __name__ == "__main__":
    main()
