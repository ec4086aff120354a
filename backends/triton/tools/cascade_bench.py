"""Cascade attention on the triton backend: correctness and attention time, cascade vs plain.

The target case (issue #26): 64 decoding requests sharing a 4,096-token prefix plus 256 own
tokens each (bf16, 32 query / 8 KV heads, head size 128, block size 16). Also: the same batch
with nothing shared (the plain path, and the planner's host cost per step), and a sweep over
(requests, prefix) that locates the break-even behind `pagedcore.attention.cascade`'s rule.
Unused cache slots are NaN. ``--smoke`` runs tiny shapes (Triton's interpreter on CPU).

    python3 backends/triton/tools/cascade_bench.py --json OUT.json [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from typing import Any

import attrs
import torch


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=False).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


class Step:
    """A decode step of `num_reqs` requests: `prefix` shared tokens (the same physical blocks
    when `shared`, else a private copy each) plus `own` tokens, and one new query token."""

    def __init__(self, num_reqs: int, prefix: int, own: int, *, shared: bool, heads: int,
                 kv_heads: int, head_size: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, seed: int = 0) -> None:
        from pagedcore.attention import CommonAttentionMetadata

        g = torch.Generator(device=device).manual_seed(seed)  # a GB of cache: make it there
        bs = block_size
        seq = prefix + own + 1
        n_pfx, n_own = prefix // bs, -(-(seq - prefix) // bs)
        next_id = 1
        pfx_ids = list(range(next_id, next_id + n_pfx))
        next_id += n_pfx
        tables = []
        for _ in range(num_reqs):
            mine = pfx_ids if shared else list(range(next_id, next_id + n_pfx))
            if not shared:
                next_id += n_pfx
            tables.append(mine + list(range(next_id, next_id + n_own)))
            next_id += n_own
        num_blocks = next_id
        cache = torch.randn((2, num_blocks, bs, kv_heads, head_size), generator=g,
                            device=device, dtype=dtype)
        cache[:, 0] = float("nan")  # the null block
        if seq % bs:
            tails = torch.tensor([t[-1] for t in tables], device=device)
            cache[:, tails, seq % bs:] = float("nan")  # past each sequence's end
        self.cache = cache
        self.tables = tables
        self.contexts = [seq - 1] * num_reqs
        self.query = torch.randn((num_reqs, heads, head_size), generator=g, device=device,
                                 dtype=dtype)
        width = len(tables[0]) + 1
        table = torch.zeros((num_reqs, width), dtype=torch.int32)
        for r, t in enumerate(tables):
            table[r, : len(t)] = torch.tensor(t, dtype=torch.int32)
        qsl = torch.arange(num_reqs + 1, dtype=torch.int32)
        lens = torch.full((num_reqs,), seq, dtype=torch.int32)
        slots = torch.tensor([t[(seq - 1) // bs] * bs + (seq - 1) % bs for t in tables])
        self.common = CommonAttentionMetadata(
            query_start_loc=qsl.to(device), query_start_loc_cpu=qsl,
            seq_lens=lens.to(device), seq_lens_cpu=lens, num_reqs=num_reqs,
            num_actual_tokens=num_reqs, max_query_len=1, max_seq_len=seq,
            block_table=table.to(device), slot_mapping=slots.to(device),
            positions=torch.full((num_reqs,), seq - 1, dtype=torch.int64, device=device),
        )


def set_target_shape(args: argparse.Namespace, *, smoke: bool) -> torch.device:
    """Fill `args` with the target step's shape (issue 26: 64 requests x (4,096 shared + 256
    own) tokens, 32 / 8 heads, d128, block 16, bf16, on CUDA) or, with `smoke`, a tiny one
    for Triton's interpreter (4 x (32 + 16), 4 / 2 heads, d64, float32, on the CPU); return
    the device."""
    if smoke:
        args.reqs, args.prefix, args.own = 4, 32, 16
        args.heads, args.kv_heads, args.head_size, args.block_size = 4, 2, 64, 16
        args.dtype = "float32"
        return torch.device("cpu")
    args.reqs, args.prefix, args.own = 64, 4096, 256
    args.heads, args.kv_heads, args.head_size, args.block_size = 32, 8, 128, 16
    args.dtype = "bfloat16"
    return torch.device("cuda")


def _setup(step: Step, args: argparse.Namespace, device: torch.device) -> tuple[Any, Any]:
    from pagedcore_triton import TritonAttentionBackend

    from pagedcore.kv_cache.spec import FullAttentionSpec

    spec = FullAttentionSpec(block_size=args.block_size, num_kv_heads=args.kv_heads,
                             head_size=args.head_size, dtype=args.dtype)
    builder = TritonAttentionBackend.get_builder_cls()(spec, ["layer.0"], device)
    impl = TritonAttentionBackend.get_impl_cls()(
        args.heads, args.head_size, args.head_size ** -0.5, num_kv_heads=args.kv_heads,
        alibi_slopes=None, sliding_window=None, logits_soft_cap=None, kv_cache_dtype="auto",
    )
    return builder, impl


def _target(args: argparse.Namespace, device: torch.device) -> tuple[Any, ...]:
    """The target step with its builder and impl, the shared length, and the plain plan
    with its output (computed once): ``(step, builder, impl, P, plain_meta, out_plain)``."""
    from pagedcore.attention.cascade import common_prefix_len

    step = Step(args.reqs, args.prefix, args.own, shared=True, heads=args.heads,
                kv_heads=args.kv_heads, head_size=args.head_size,
                block_size=args.block_size, dtype=getattr(torch, args.dtype), device=device)
    builder, impl = _setup(step, args, device)
    p = common_prefix_len(step.tables, step.contexts, args.block_size)
    plain_meta = builder.build(step.common)
    out_plain = torch.empty_like(step.query)
    impl.forward(step.query, step.query, step.query, step.cache, plain_meta, output=out_plain)
    return step, builder, impl, p, plain_meta, out_plain


def _timer(smoke: bool, device: torch.device, budget_ms: float) -> Any:
    if smoke:
        def once(fn: Any) -> float:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        return once
    from pagedcore.bench.kernel_primitives import time_ms

    return lambda fn: time_ms(fn, device, budget_ms=budget_ms)


def measure(num_reqs: int, prefix: int, own: int, args: argparse.Namespace,
            device: torch.device, *, budget_ms: float) -> dict[str, Any]:
    """Plain vs cascade on one shared-prefix decode step (time per layer, rel error)."""
    from pagedcore.attention.cascade import cascade_pays, common_prefix_len

    dtype = getattr(torch, args.dtype)
    step = Step(num_reqs, prefix, own, shared=True, heads=args.heads, kv_heads=args.kv_heads,
                head_size=args.head_size, block_size=args.block_size, dtype=dtype,
                device=device)
    builder, impl = _setup(step, args, device)
    p = common_prefix_len(step.tables, step.contexts, args.block_size)
    plain_meta = builder.build(step.common)
    casc_meta = builder.build(step.common, common_prefix_len=p)
    assert casc_meta.cascade is not None
    out_plain = torch.empty_like(step.query)
    out_casc = torch.empty_like(step.query)

    def plain() -> None:
        impl.forward(step.query, step.query, step.query, step.cache, plain_meta,
                     output=out_plain)

    def cascade() -> None:
        impl.forward(step.query, step.query, step.query, step.cache, casc_meta,
                     output=out_casc)

    plain()
    cascade()
    err = float((out_casc.float() - out_plain.float()).abs().max()
                / out_plain.float().abs().max())
    nan = bool(torch.isnan(out_casc).any() or torch.isnan(out_plain).any())
    timer = _timer(args.smoke, device, budget_ms)
    t_plain, t_casc = timer(plain), timer(cascade)
    return {
        "num_reqs": num_reqs, "prefix": prefix, "own": own, "common_prefix_len": p,
        "plain_ms": t_plain, "cascade_ms": t_casc, "speedup": t_plain / t_casc,
        "rel_err_cascade_vs_plain": err, "nan": nan,
        "rule_pays": cascade_pays(p, num_reqs),
    }


def components(args: argparse.Namespace, device: torch.device, *,
               variants: list[str]) -> dict[str, Any]:
    """Where the target step's cascade time goes: the prefix launch alone, the suffix launch
    (with its fused merge) alone, and the whole step under each prefix-launch variant of
    `variants` (``PAGEDCORE_TRITON_CASCADE_PREFIX`` texts; "" is the default shape)."""
    from pagedcore_triton.cascade import (
        CASCADE_PREFIX_ENV,
        prefix_config,
        run_prefix,
        suffix_tiles,
    )


    dtype = getattr(torch, args.dtype)
    step, builder, impl, p, plain_meta, out_plain = _target(args, device)
    timer = _timer(args.smoke, device, 200.0)
    rows: dict[str, Any] = {"plain_ms": timer(lambda: impl.forward(
        step.query, step.query, step.query, step.cache, plain_meta, output=out_plain))}
    before = os.environ.get(CASCADE_PREFIX_ENV)
    variant_rows = []
    try:
        for text in variants:
            if text:
                os.environ[CASCADE_PREFIX_ENV] = text
            else:
                os.environ.pop(CASCADE_PREFIX_ENV, None)
            meta = builder.build(step.common, common_prefix_len=p)
            plan = meta.cascade
            assert plan is not None
            out = torch.empty_like(step.query)

            def cascade(meta: Any = meta, out: torch.Tensor = out) -> None:
                impl.forward(step.query, step.query, step.query, step.cache, meta, output=out)

            try:
                cascade()
            except Exception as e:  # a variant the compiler rejects (shared memory, ...)
                variant_rows.append({"variant": text, "error": f"{type(e).__name__}: {e}"[:300]})
                print(f"variant {text!r}: {e}"[:300], flush=True)
                continue
            err = float((out.float() - out_plain.float()).abs().max()
                        / out_plain.float().abs().max())
            cfg = prefix_config(num_tokens=plan.num_tokens, num_heads=args.heads,
                                num_kv_heads=args.kv_heads, head_size=args.head_size,
                                block_size=args.block_size, prefix_len=p,
                                num_sms=(torch.cuda.get_device_properties(device)
                                         .multi_processor_count if device.type == "cuda"
                                         else 4),
                                override=text or None)
            row: dict[str, Any] = {"variant": text or "default", "config": attrs.asdict(cfg),
                                   "cascade_ms": timer(cascade), "rel_err": err,
                                   "nan": bool(torch.isnan(out).any())}
            row["speedup"] = rows["plain_ms"] / row["cascade_ms"]
            if not text:
                row["prefix_only_ms"] = timer(lambda plan=plan: run_prefix(
                    plan, step.query, step.cache, scale=impl.scale, logits_soft_cap=None))
                launch = impl._prepared(  # the bench times the suffix launch alone
                    meta, ("cascade", args.heads, dtype, step.cache.shape, impl._features),
                    plan.suffix_part, step.query, step.cache, seq_lens=plan.suffix_seq_lens,
                    block_table=plan.suffix_table, use_alibi=False, sliding_window=None,
                    tiles=suffix_tiles(plan.suffix_part, num_queries_per_kv=impl.num_queries_per_kv,
                                       head_size=args.head_size, dtype=dtype))
                from pagedcore_triton.ops import run_launch

                pfx = run_prefix(plan, step.query, step.cache, scale=impl.scale,
                                 logits_soft_cap=None)
                row["suffix_segments"] = launch.constexprs["NUM_SEGMENTS"]

                def suffix(launch: Any = launch, pfx: Any = pfx, out: Any = out) -> None:
                    run_launch(launch, step.query, step.cache, out, scale=impl.scale,
                               alibi_slopes=None, sliding_window=None, logits_soft_cap=None,
                               merge=False,
                               prefix_partials=pfx if launch.part_acc is None else None)

                row["suffix_with_merge_ms"] = timer(suffix)
            print(f"variant {row['variant']}: {row}", flush=True)
            variant_rows.append(row)
    finally:
        if before is None:
            os.environ.pop(CASCADE_PREFIX_ENV, None)
        else:
            os.environ[CASCADE_PREFIX_ENV] = before
    rows["variants"] = variant_rows
    return rows


def suffix_variants(args: argparse.Namespace, device: torch.device, *,
                    tiles: list[str], segments: list[int]) -> dict[str, Any]:
    """The target step's whole cascade under each suffix-launch shape: split-KV segments of
    the suffix (`segments`; 1 fuses the merge into the suffix launch, more add the merge
    launch) x decode tile shapes (`tiles`: ``PAGEDCORE_TRITON_DECODE_TILES`` texts, "" the
    default), with the default prefix launch."""
    from pagedcore_triton.plan import DECODE_TILES_ENV


    step, builder, impl, p, _plain, out_plain = _target(args, device)
    timer = _timer(args.smoke, device, 150.0)
    rows: list[dict[str, Any]] = []
    before = os.environ.get(DECODE_TILES_ENV)
    try:
        for tile in tiles:
            if tile:
                os.environ[DECODE_TILES_ENV] = tile
            else:
                os.environ.pop(DECODE_TILES_ENV, None)
            for s in segments:
                builder.decode_segments = lambda s=s, **_: s  # type: ignore[method-assign]
                meta = builder.build(step.common, common_prefix_len=p)
                out = torch.empty_like(step.query)

                def cascade(meta: Any = meta, out: torch.Tensor = out) -> None:
                    impl.forward(step.query, step.query, step.query, step.cache, meta,
                                 output=out)

                row: dict[str, Any] = {"tiles": tile or "default", "suffix_segments": s}
                try:
                    cascade()
                except Exception as e:  # a shape the compiler rejects
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                else:
                    row["rel_err"] = float((out.float() - out_plain.float()).abs().max()
                                           / out_plain.float().abs().max())
                    row["nan"] = bool(torch.isnan(out).any())
                    row["cascade_ms"] = timer(cascade)
                print(f"suffix: {row}", flush=True)
                rows.append(row)
    finally:
        del builder.decode_segments
        if before is None:
            os.environ.pop(DECODE_TILES_ENV, None)
        else:
            os.environ[DECODE_TILES_ENV] = before
    return {"rows": rows}


def unshared(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Nothing shared: the plain path's time and the engine-side planner's host cost."""
    from pagedcore.attention.cascade import common_prefix_len

    dtype = getattr(torch, args.dtype)
    step = Step(args.reqs, args.prefix, args.own, shared=False, heads=args.heads,
                kv_heads=args.kv_heads, head_size=args.head_size,
                block_size=args.block_size, dtype=dtype, device=device)
    builder, impl = _setup(step, args, device)
    reps = 200
    start = time.perf_counter()
    for _ in range(reps):
        p = common_prefix_len(step.tables, step.contexts, args.block_size)
    planner_us = (time.perf_counter() - start) / reps * 1e6
    meta = builder.build(step.common, common_prefix_len=p)
    out = torch.empty_like(step.query)

    def plain() -> None:
        impl.forward(step.query, step.query, step.query, step.cache, meta, output=out)

    t = _timer(args.smoke, device, 400.0)(plain)
    return {"num_reqs": args.reqs, "prefix_private": args.prefix, "own": args.own,
            "common_prefix_len": p, "plain_ms": t, "planner_host_us": planner_us,
            "cascade_planned": meta.cascade is not None}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, CPU interpreter")
    ap.add_argument("--parts", default="target,components,unshared,sweep",
                    help="comma list of target, components, suffix, unshared, sweep (in that "
                         "order; the JSON is rewritten after each)")
    ap.add_argument("--variants", default="",
                    help="';'-separated PAGEDCORE_TRITON_CASCADE_PREFIX texts the components "
                         "part also times (the default shape always runs first)")
    ap.add_argument("--suffix-tiles", default=";128,4,3;32,4,4;64,8,3",
                    help="';'-separated PAGEDCORE_TRITON_DECODE_TILES texts the suffix part "
                         "times ('' is the default shape)")
    ap.add_argument("--suffix-segments", default="1,2,4,8",
                    help="comma list of suffix split-KV segment counts the suffix part times")
    ap.add_argument("--sweep-reqs", default=None, help="comma list (default: 2..64)")
    ap.add_argument("--sweep-prefix", default=None, help="comma list (default: 256,1024,4096)")
    args = ap.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(parts) - {"target", "components", "suffix", "unshared", "sweep"}
    if unknown:
        ap.error(f"--parts: unknown {sorted(unknown)}; pick from target, components, "
                 "suffix, unshared, sweep")
    device = set_target_shape(args, smoke=args.smoke)
    if args.smoke:
        sweep_reqs, sweep_prefix = [2, 4], [32]
    else:
        sweep_reqs, sweep_prefix = [2, 4, 8, 16, 32, 64], [256, 1024, 4096]
    if args.sweep_reqs:
        sweep_reqs = [int(x) for x in args.sweep_reqs.split(",")]
    if args.sweep_prefix:
        sweep_prefix = [int(x) for x in args.sweep_prefix.split(",")]
    result: dict[str, Any] = {
        "command": "bash docs/benchmarks/run_cascade_h200.sh" + (" --smoke" if args.smoke
                                                                 else ""),
        "commit": os.environ.get("PAGEDCORE_GIT_COMMIT") or _commit(),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.node(),
        "shape": {"heads": args.heads, "kv_heads": args.kv_heads, "head_size": args.head_size,
                  "block_size": args.block_size, "dtype": args.dtype},
        "interpreter": os.environ.get("TRITON_INTERPRET") == "1",
    }

    def save() -> None:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)

    for part in parts:
        if part == "target":
            target = measure(args.reqs, args.prefix, args.own, args, device, budget_ms=400.0)
            print(f"target: {target}", flush=True)
            result["target"] = target
            result["target_met"] = target["speedup"] >= 4.0
        elif part == "components":
            variants = [""] + [v.strip() for v in args.variants.split(";") if v.strip()]
            result["components"] = components(args, device, variants=variants)
        elif part == "suffix":
            result["suffix"] = suffix_variants(
                args, device, tiles=[t.strip() for t in args.suffix_tiles.split(";")],
                segments=[int(x) for x in args.suffix_segments.split(",")])
        elif part == "unshared":
            none = unshared(args, device)
            print(f"unshared: {none}", flush=True)
            result["unshared"] = none
        else:
            sweep = result["sweep"] = []
            for p in sweep_prefix:
                for n in sweep_reqs:
                    row = measure(n, p, args.own, args, device, budget_ms=120.0)
                    print(f"sweep: n={n} P={p} plain {row['plain_ms']:.4f} ms cascade "
                          f"{row['cascade_ms']:.4f} ms x{row['speedup']:.2f} "
                          f"pays={row['rule_pays']} err {row['rel_err_cascade_vs_plain']:.1e}",
                          flush=True)
                    sweep.append(row)
                    # Where the rule (cascade_pays) and the measurement disagree: tune it.
                    result["rule_disagrees"] = [
                        (r["num_reqs"], r["prefix"], round(r["speedup"], 3))
                        for r in sweep if r["rule_pays"] != (r["speedup"] > 1.0)]
                    save()
        save()
    print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
