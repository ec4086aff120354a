"""Where the target cascade step's time goes, and what overlapping its launches would buy.

Issue 26's target step (64 decodes sharing 4,096 tokens plus 256 own each; bf16, 32 query /
8 KV heads, head size 128, block size 16; unused slots NaN): the step's two launches timed
alone and together (`pagedcore.bench.kernel_primitives.time_ms`: back-to-back calls after an
L2 flush), each kernel's own device time from the profiler (so launch gaps show as the
difference), the suffix launch without the prefix merge and the same decode with no prefix at
all, prefix-launch shapes (``PAGEDCORE_TRITON_CASCADE_PREFIX``), the prefix and a split
suffix launch on two streams with the merge after them, and every path replayed from a CUDA
graph. Each output is checked against the plain step's before it is timed.

    python3 backends/triton/tools/cascade_probe.py --json OUT.json [--smoke]
    ncu --clock-control none --kernel-name regex:"cascade_prefix|paged_attention" \
        --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section WarpStateStats python3 backends/triton/tools/cascade_probe.py --json x --ncu
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

PREFIX_VARIANTS = ["64,32,8,3,2,r128", "64,32,8,4,2,r128", "64,64,8,3,2,r128",
                   "64,32,4,3,3,r168", "64,32,4,4,3,r168", "64,64,8,3,1", "64,32,4,3,2",
                   "128,64,8,3,1", "64,64,4,3,4"]
SUFFIX_VARIANTS = ["32,4,3", "16,4,4", "32,4,4,s,i32", "32,2,3", "64,4,2"]


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max())


def _profile(fn: Callable[[], None], calls: int) -> list[dict[str, Any]]:
    """`fn`'s kernels, own device microseconds per call (`torch.profiler`)."""
    from torch.profiler import ProfilerActivity, profile

    from pagedcore.bench.kernel_primitives import kernel_summary

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return kernel_summary(prof, calls)


def _graph_rel_err(fn: Callable[[], None], out: torch.Tensor, ref: torch.Tensor,
                   device: torch.device) -> float:
    """Relative error of `out` after `fn` is replayed from a CUDA graph that first fills
    `out` with NaN (a replay that writes nothing, or only part, shows)."""
    from pagedcore.bench.kernel_primitives import graph_time_ms

    def poisoned() -> None:
        out.fill_(float("nan"))
        fn()

    graph_time_ms(poisoned, device, calls=1, budget_ms=5.0)
    torch.cuda.synchronize()
    return _rel(out, ref)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import cascade_bench as cb
    from pagedcore_triton.cascade import (
        CASCADE_PREFIX_ENV,
        prefix_config,
        run_prefix,
        suffix_tiles,
    )
    from pagedcore_triton.kernels.cascade import cascade_merge_kernel
    from pagedcore_triton.ops import run_launch

    from pagedcore.bench.kernel_primitives import graph_time_ms

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (interpreter on CPU)")
    ap.add_argument("--ncu", action="store_true",
                    help="only launch the plain step, the cascade twice and the own-only "
                         "decode once (for Nsight Compute), then exit")
    ap.add_argument("--no-sweeps", action="store_true",
                    help="skip the prefix- and suffix-shape sweeps (their compiles take most "
                         "of the run)")
    args = ap.parse_args(argv)
    device = cb.set_target_shape(args, smoke=args.smoke)
    dtype = getattr(torch, args.dtype)
    cuda = device.type == "cuda"
    timer = cb._timer(args.smoke, device, 200.0)
    result: dict[str, Any] = {
        "command": "python3 backends/triton/tools/cascade_probe.py" + (" --smoke" if args.smoke
                                                                       else ""),
        "commit": os.environ.get("PAGEDCORE_GIT_COMMIT") or cb._commit(),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "shape": {"reqs": args.reqs, "prefix": args.prefix, "own": args.own,
                  "heads": args.heads, "kv_heads": args.kv_heads, "head_size": args.head_size,
                  "block_size": args.block_size, "dtype": args.dtype},
    }

    def save() -> None:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)

    step, builder, impl, p, plain_meta, out_plain = cb._target(args, device)
    q, cache = step.query, step.cache
    meta = builder.build(step.common, common_prefix_len=p)
    plan = meta.cascade
    assert plan is not None
    out = torch.empty_like(q)

    def plain() -> None:
        impl.forward(q, q, q, cache, plain_meta, output=out_plain)

    def cascade() -> None:
        impl.forward(q, q, q, cache, meta, output=out)

    cascade()
    result["rel_err_cascade"] = _rel(out, out_plain)
    if args.ncu:
        cascade()
        own = cb.Step(args.reqs, 0, args.own, shared=False, heads=args.heads,
                      kv_heads=args.kv_heads, head_size=args.head_size,
                      block_size=args.block_size, dtype=dtype, device=device, seed=1)
        own_out = torch.empty_like(own.query)
        impl.forward(own.query, own.query, own.query, own.cache, builder.build(own.common),
                     output=own_out)
        print(f"ncu launches done; cascade rel. error {result['rel_err_cascade']:.1e}")
        return result
    result["nan"] = bool(torch.isnan(out).any())
    result["plain_ms"] = timer(plain)
    result["cascade_ms"] = timer(cascade)
    result["speedup"] = result["plain_ms"] / result["cascade_ms"]
    print(f"plain {result['plain_ms']:.4f} cascade {result['cascade_ms']:.4f} "
          f"x{result['speedup']:.2f} err {result['rel_err_cascade']:.1e}", flush=True)
    save()

    # The two launches alone; the suffix without the prefix merge (its output is then
    # the suffix's own attention: timing only).
    launch = impl._prepared(
        meta, ("cascade", args.heads, dtype, cache.shape, impl._features), plan.suffix_part,
        q, cache, seq_lens=plan.suffix_seq_lens, block_table=plan.suffix_table,
        use_alibi=False, sliding_window=None,
        tiles=suffix_tiles(plan.suffix_part, num_queries_per_kv=impl.num_queries_per_kv,
                           head_size=args.head_size, dtype=dtype))
    pfx = run_prefix(plan, q, cache, scale=impl.scale, logits_soft_cap=None)
    scratch = torch.empty_like(q)
    parts = {
        "prefix_only_ms": lambda: run_prefix(plan, q, cache, scale=impl.scale,
                                             logits_soft_cap=None),
        "suffix_with_merge_ms": lambda: run_launch(
            launch, q, cache, scratch, scale=impl.scale, alibi_slopes=None,
            sliding_window=None, logits_soft_cap=None, merge=False, prefix_partials=pfx),
        "suffix_no_merge_ms": lambda: run_launch(
            launch, q, cache, scratch, scale=impl.scale, alibi_slopes=None,
            sliding_window=None, logits_soft_cap=None, merge=False),
    }
    for name, fn in parts.items():
        result[name] = timer(fn)
    own = cb.Step(args.reqs, 0, args.own, shared=False, heads=args.heads,
                  kv_heads=args.kv_heads, head_size=args.head_size, block_size=args.block_size,
                  dtype=dtype, device=device, seed=1)
    own_meta = builder.build(own.common)
    own_out = torch.empty_like(own.query)
    result["own_only_decode_ms"] = timer(lambda: impl.forward(
        own.query, own.query, own.query, own.cache, own_meta, output=own_out))
    print({k: round(result[k], 4) for k in [*parts, "own_only_decode_ms"]}, flush=True)
    if cuda:
        result["profiler_kernels"] = {"cascade": _profile(cascade, 50),
                                      "plain": _profile(plain, 20)}
        print(result["profiler_kernels"], flush=True)
    save()

    # Two streams: the prefix beside a split suffix launch (partials), then the merge.
    if cuda:
        builder.decode_segments = lambda **_: 2  # type: ignore[method-assign]
        smeta = builder.build(step.common, common_prefix_len=p)
        del builder.decode_segments
        splan = smeta.cascade
        slaunch = impl._prepared(
            smeta, ("cascade", args.heads, dtype, cache.shape, impl._features),
            splan.suffix_part, q, cache, seq_lens=splan.suffix_seq_lens,
            block_table=splan.suffix_table, use_alibi=False, sliding_window=None,
            tiles=suffix_tiles(splan.suffix_part, num_queries_per_kv=impl.num_queries_per_kv,
                               head_size=args.head_size, dtype=dtype))
        assert slaunch.part_acc is not None
        side = torch.cuda.Stream()
        sout = torch.empty_like(q)

        def two_streams(concurrent: bool = True) -> None:
            main = torch.cuda.current_stream()
            if concurrent:
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    pacc, pml = run_prefix(splan, q, cache, scale=impl.scale,
                                           logits_soft_cap=None)
            else:
                pacc, pml = run_prefix(splan, q, cache, scale=impl.scale, logits_soft_cap=None)
            run_launch(slaunch, q, cache, sout, scale=impl.scale, alibi_slopes=None,
                       sliding_window=None, logits_soft_cap=None, merge=False)
            if concurrent:
                main.wait_stream(side)
            cascade_merge_kernel[(splan.num_tokens,)](
                sout, slaunch.part_acc, slaunch.part_ml, pacc, pml, args.heads,
                sout.stride(0), sout.stride(1), HEAD_SIZE=args.head_size,
                HEAD_PAD=pacc.shape[-1], HEADS_PAD=triton_next_pow2(args.heads),
                SUFFIX_SEGMENTS=slaunch.constexprs["NUM_SEGMENTS"],
                PREFIX_SEGMENTS=pacc.shape[2], num_warps=4)

        two_streams()
        torch.cuda.synchronize()
        result["two_streams"] = {
            "suffix_segments": slaunch.constexprs["NUM_SEGMENTS"],
            "rel_err": _rel(sout, out_plain),
            "serial_ms": timer(lambda: two_streams(False)),
            "concurrent_ms": timer(two_streams),
        }
        print(f"two streams {result['two_streams']}", flush=True)
        save()
        graphs: dict[str, Any] = {}
        for name, fn in (("plain", plain), ("cascade", cascade),
                         ("two_streams", two_streams)):
            try:
                graphs[f"{name}_ms"] = graph_time_ms(fn, device, calls=1)
            except Exception as e:
                graphs[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
        graphs["cascade_rel_err"] = _graph_rel_err(cascade, out, out_plain, device)
        if "plain_ms" in graphs and "cascade_ms" in graphs:
            graphs["speedup"] = graphs["plain_ms"] / graphs["cascade_ms"]
        if "plain_ms" in graphs and "two_streams_ms" in graphs:
            graphs["two_streams_speedup"] = graphs["plain_ms"] / graphs["two_streams_ms"]
        result["cuda_graph_replay"] = graphs
        print(f"graphs {graphs}", flush=True)
        save()
        # The library's overlap (PAGEDCORE_TRITON_CASCADE_OVERLAP=1), eager and graphed.
        from pagedcore_triton.cascade import CASCADE_OVERLAP_ENV

        os.environ[CASCADE_OVERLAP_ENV] = "1"
        try:
            ometa = builder.build(step.common, common_prefix_len=p)
            oout = torch.empty_like(q)

            def overlapped() -> None:
                impl.forward(q, q, q, cache, ometa, output=oout)

            overlapped()
            torch.cuda.synchronize()
            lib: dict[str, Any] = {"rel_err": _rel(oout, out_plain),
                                   "suffix_segments": ometa.cascade.suffix_part.num_segments,
                                   "cascade_ms": timer(overlapped)}
            lib["graph_rel_err"] = _graph_rel_err(overlapped, oout, out_plain, device)
            lib["graph_ms"] = graph_time_ms(overlapped, device, calls=1)
        except Exception as e:
            lib = {"error": f"{type(e).__name__}: {e}"[:300]}
        finally:
            os.environ.pop(CASCADE_OVERLAP_ENV, None)
        result["library_overlap"] = lib
        print(f"library overlap {lib}", flush=True)

    def sweep(name: str, env: str, texts: list[str],
              measure: Callable[[str], dict[str, Any]]) -> None:
        """`measure` each shape text with `env` set to it, one JSON row each (a shape the
        compiler rejects records its error), saved as it goes under `name`."""
        rows: list[dict[str, Any]] = []
        for text in texts:
            os.environ[env] = text
            try:
                row = {"variant": text, **measure(text)}
            except Exception as e:
                row = {"variant": text, "error": f"{type(e).__name__}: {e}"[:300]}
            finally:
                os.environ.pop(env, None)
            print(f"{name}: {row}", flush=True)
            rows.append(row)
            result[name] = rows
            save()

    sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 4

    def prefix_shape(text: str) -> dict[str, Any]:
        vmeta = builder.build(step.common, common_prefix_len=p)
        vplan = vmeta.cascade
        vout = torch.empty_like(q)
        impl.forward(q, q, q, cache, vmeta, output=vout)
        cfg = prefix_config(num_tokens=vplan.num_tokens, num_heads=args.heads,
                            num_kv_heads=args.kv_heads, head_size=args.head_size,
                            block_size=args.block_size, prefix_len=p, num_sms=sms,
                            override=text)
        return {"segments": cfg.segments, "m_tiles": cfg.m_tiles,
                "rel_err": _rel(vout, out_plain),
                "cascade_ms": timer(lambda: impl.forward(q, q, q, cache, vmeta, output=vout)),
                "prefix_only_ms": timer(lambda: run_prefix(vplan, q, cache, scale=impl.scale,
                                                           logits_soft_cap=None))}

    def suffix_shape(text: str) -> dict[str, Any]:
        vmeta = builder.build(step.common, common_prefix_len=p)
        vout = torch.empty_like(q)
        impl.forward(q, q, q, cache, vmeta, output=vout)
        ometa = builder.build(own.common)
        return {"rel_err": _rel(vout, out_plain),
                "cascade_ms": timer(lambda: impl.forward(q, q, q, cache, vmeta, output=vout)),
                "own_only_decode_ms": timer(lambda: impl.forward(
                    own.query, own.query, own.query, own.cache, ometa, output=own_out))}

    from pagedcore_triton.plan import DECODE_TILES_ENV

    smoke = args.smoke
    if not args.no_sweeps:
        sweep("prefix_variants", CASCADE_PREFIX_ENV,
              ["16,16,4,1,2", "16,32,4,1,1,r128"] if smoke else PREFIX_VARIANTS, prefix_shape)
        sweep("suffix_variants", DECODE_TILES_ENV, ["16,4,1"] if smoke else SUFFIX_VARIANTS,
              suffix_shape)
    save()
    print(f"wrote {args.json}")
    return result


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


if __name__ == "__main__":
    main()
