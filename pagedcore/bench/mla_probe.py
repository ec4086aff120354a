"""Where the Triton MLA decode's time goes: per-program timelines and an ncu driver (CUDA only).

``python -m pagedcore.bench.mla_probe --json FILE`` runs, per bench shape and variant, the
decode kernel built with ``PROBE`` (`pagedcore_triton.mla_kernels.mla_decode_kernel`): every
program records its SM and ``%globaltimer`` (ns) at its start, after the PDL wait, after its
last tile and after its last store. Two modes per shape: ``isolated`` (the GPU idle before
one ``forward``) and ``steady`` (the last of ten back-to-back forwards, as the bench times
them). The summary says how long the programs wait, how spread their starts and ends are,
how long the streaming loop and the epilogue take, and how busy the grid is over its span
(the tail). ``--ncu`` instead just runs each variant's ``forward`` once per shape (compiled
beforehand, e.g. by the bench: the Triton cache), for ``ncu -k regex:mla_`` to profile.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from typing import Any

import click

from pagedcore.bench.mla_kernel import (
    FULL_CASES,
    LATENT,
    ROPE,
    _decode_batch,
    _impl,
    _plans,
    resolve_variants,
)

__all__ = ["main", "probe_case", "summarize_probe"]

#: Fields of a probe row: the SM, then globaltimer ns at the program's start, after the PDL
#: wait, after its last tile, after its last store; then its tile count and the SM cycles
#: (``%clock64``) from its start to its end.
FIELDS = ("smid", "t_start", "t_go", "t_loop", "t_end", "tiles", "cycles")


def _q(values: Sequence[float], frac: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(frac * (len(s) - 1))))]


def summarize_probe(rows: list[list[int]], kv_bytes: int) -> dict[str, Any]:
    """Statistics (µs) of one launch's probe rows ``[smid, t_start, t_go, t_loop, t_end,
    tiles, ...]``: waits, start and end spreads, loop and epilogue times, and how busy the
    grid is over its span (sum of program durations / (programs x span))."""
    go0 = min(r[2] for r in rows)
    us = 1e-3
    wait = [(r[2] - r[1]) * us for r in rows]
    dur = [(r[4] - r[2]) * us for r in rows]
    loop = [(r[3] - r[2]) * us for r in rows]
    epi = [(r[4] - r[3]) * us for r in rows]
    ends = [(r[4] - go0) * us for r in rows]
    starts = [(r[2] - go0) * us for r in rows]
    span = max(ends)
    per_sm: dict[int, int] = {}
    for r in rows:
        per_sm[r[0]] = per_sm.get(r[0], 0) + 1
    alone = [d for r, d in zip(rows, dur, strict=True) if per_sm[r[0]] == 1]
    shared = [d for r, d in zip(rows, dur, strict=True) if per_sm[r[0]] > 1]
    tiles = [r[5] for r in rows]
    # The SM clock from the programs' cycle counts over their globaltimer durations.
    ghz = [r[6] / (r[4] - r[1]) for r in rows if r[4] > r[1]]
    per_tile = [lp / t for lp, t in zip(loop, tiles, strict=True) if t > 0]

    def stats(v: Sequence[float]) -> dict[str, float]:
        if not v:
            return {}
        return {"min": round(min(v), 3), "p10": round(_q(v, 0.1), 3),
                "med": round(statistics.median(v), 3), "p90": round(_q(v, 0.9), 3),
                "max": round(max(v), 3)}

    return {
        "programs": len(rows), "sms": len(per_sm),
        "programs_per_sm": {str(k): sum(1 for c in per_sm.values() if c == k)
                            for k in sorted(set(per_sm.values()))},
        "tiles_per_program": stats([float(t) for t in tiles]),
        "wait_us": stats(wait), "start_us": stats(starts), "end_us": stats(ends),
        "duration_us": stats(dur), "loop_us": stats(loop), "epilogue_us": stats(epi),
        "loop_us_per_tile": stats(per_tile),
        "duration_alone_on_sm_us": stats(alone), "duration_shared_sm_us": stats(shared),
        "sm_clock_GHz": stats(ghz),
        "span_us": round(span, 2),
        "busy_fraction": round(sum(dur) / (len(rows) * span), 3) if span > 0 else None,
        "kv_GBps_over_span": round(kv_bytes / (span * 1e3), 1) if span > 0 else None,
    }


def probe_case(config: Any, batch: int, context: int, *, steady_reps: int = 10
               ) -> dict[str, Any]:
    """Probe rows and summaries of `config`'s decode at one shape (isolated and steady)."""
    import torch

    device = torch.device("cuda")
    dtype = torch.bfloat16
    cache, query, common = _decode_batch(batch, context, device, dtype)
    meta, _ = _plans(common, device, dtype)
    impl = _impl(config)
    kv_bytes = batch * context * (LATENT + ROPE) * cache.element_size()
    launch = impl.plan_launch(query, meta)
    programs = launch.num_tokens * launch.head_blocks * launch.splits
    probe = torch.zeros(programs, 8, dtype=torch.int64, device=device)
    out = query.new_empty(batch, query.shape[1], LATENT)

    def step() -> None:
        impl.launch_decode(launch, query, cache, meta, out, probe=probe)
        if launch.splits > 1:
            impl.launch_merge(launch, out)

    step()  # compile
    want = impl.forward(query, query, query, cache, meta).float()
    step()
    torch.cuda.synchronize()
    rel = float((out.float() - want).norm() / want.norm())
    result: dict[str, Any] = {
        "variant": config.name, "batch": batch, "context": context,
        "splits": launch.splits, "heads_per_program": launch.heads_per_program,
        "kv_bytes": kv_bytes, "rel_err_vs_forward": rel,
    }
    flush = torch.empty(256 << 20, dtype=torch.int8, device=device)
    for mode, reps in (("isolated", 1), ("steady", steady_reps)):
        flush.zero_()
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        for _ in range(reps):
            step()
        end.record()
        end.synchronize()
        rows: list[list[int]] = probe.cpu().tolist()
        result[mode] = summarize_probe(rows, kv_bytes)
        result[mode]["event_us_per_step"] = round(start.elapsed_time(end) * 1e3 / reps, 2)
        result[f"{mode}_rows"] = [r[:7] for r in rows]
    return result


def _line(r: dict[str, Any], mode: str) -> str:
    s = r[mode]
    return (f"{r['variant']} {r['batch']}x{r['context']} {mode}: splits {r['splits']} "
            f"heads/prog {r['heads_per_program']} programs {s['programs']} on {s['sms']} SMs; "
            f"step {s['event_us_per_step']} us, span {s['span_us']} us, busy "
            f"{s['busy_fraction']}; wait med/max {s['wait_us']['med']}/{s['wait_us']['max']}; "
            f"start p90/max {s['start_us']['p90']}/{s['start_us']['max']}; end "
            f"min/p10/med/max {s['end_us']['min']}/{s['end_us']['p10']}/"
            f"{s['end_us']['med']}/{s['end_us']['max']}; loop med {s['loop_us']['med']} "
            f"({s['loop_us_per_tile']['med']}/tile), epilogue med/max "
            f"{s['epilogue_us']['med']}/{s['epilogue_us']['max']}; dur alone/shared med "
            f"{s['duration_alone_on_sm_us'].get('med')}/{s['duration_shared_sm_us'].get('med')}")


@click.command()
@click.option("--variants", default=None, help="Comma-separated MLA_KERNEL_CONFIGS names "
              "(default: the shipped default).")
@click.option("--shapes", default=None, help="batch x context list, e.g. 4x32768,64x4096 "
              "(default: the bench's five).")
@click.option("--json", "json_path", default=None, help="Write the results here.")
@click.option("--ncu", is_flag=True, help="Only run each variant's forward once per shape, "
              "for ncu to profile (decode, then merge when split).")
def main(variants: str | None, shapes: str | None, json_path: str | None, ncu: bool) -> None:
    """Per-program timelines of the Triton MLA decode (CUDA only)."""
    import torch

    if not torch.cuda.is_available():
        raise click.UsageError("mla_probe needs a CUDA GPU (globaltimer / smid probes)")
    cases = FULL_CASES if shapes is None else tuple(
        (int(b), int(c)) for b, c in (s.split("x") for s in shapes.split(",")))
    configs = resolve_variants(variants)
    if ncu:
        device = torch.device("cuda")
        for batch, context in cases:
            cache, query, common = _decode_batch(batch, context, device, torch.bfloat16)
            meta, _ = _plans(common, device, torch.bfloat16)
            for cfg in configs:
                _impl(cfg).forward(query, query, query, cache, meta)
                torch.cuda.synchronize()
                print(f"ncu launches: {cfg.name} {batch}x{context}", flush=True)
            del cache, query
        return
    results = []
    for batch, context in cases:
        for cfg in configs:
            r = probe_case(cfg, batch, context)
            torch.cuda.empty_cache()  # the case's cache and partials are gone
            results.append(r)
            for mode in ("isolated", "steady"):
                print(_line(r, mode), flush=True)
            if json_path:
                with open(json_path, "w") as f:
                    json.dump(results, f)


if __name__ == "__main__":
    main()
