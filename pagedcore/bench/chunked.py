"""`pagedcore bench chunked`: what chunked prefill buys short requests stuck behind a long one.

Workload (a fixed arrival timeline): one long prompt arrives at t=0; 20 short requests arrive
evenly spread over the first 90% of the long prompt's *unchunked* prefill time (measured on a
warm engine, the second of two runs, then frozen for every configuration). Reported per
configuration: the short requests' TTFT and inter-token latency p50/p95/p99 (pooled over
repetitions) and the long request's completion time (median), against the same timeline
without chunking, plus the last repetition's steps (to check, e.g., that without chunking the
long prompt is one step and every short arrived during it).

Configurations change one variable at a time: ``long_prefill_token_threshold`` at a budget
large enough for the whole prompt (so only the threshold chunks it), then
``max_num_batched_tokens`` (no per-request threshold); ``--pairs`` adds configurations that
set both (a chunk size and a step cap above it); ``--unaligned`` adds threshold rows with the
scheduler's bucket alignment off (``token_buckets=None``: steps pad up to the next CUDA-graph
token bucket) next to the aligned default, for an A/B in one run. One engine serves them all
(`apply_config`), and each configuration runs the timeline once untimed first. Prefix caching
is off, so repetitions cannot hit. The JSON is rewritten after every configuration
(``"complete"`` says whether the sweep finished), so a run cut short by a timeout keeps what
it measured.
"""

from __future__ import annotations

import statistics
from typing import Any

import click

from pagedcore.cli_types import BACKEND, DEVICE, IntList, OutputPath, positive_int

__all__ = ["apply_config", "chunked", "make_timeline", "parse_pairs", "run_config", "summarize"]


def make_timeline(*, long_len: int, num_short: int, short_lens: tuple[int, int],
                  short_max_tokens: int, long_max_tokens: int, window_s: float, vocab: int,
                  seed: int = 0) -> list[Any]:
    """The long request at 0 and `num_short` short ones at ``(i + 0.5) / n * 0.9 * window_s``."""
    import torch

    from pagedcore.bench.timeline import Arrival
    from pagedcore.engine.sampling.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(seed)
    long_params = SamplingParams(max_tokens=long_max_tokens, temperature=0.0, ignore_eos=True)
    short_params = SamplingParams(max_tokens=short_max_tokens, temperature=0.0, ignore_eos=True)
    arrivals = [Arrival(request_id="long", at=0.0,
                        prompt=torch.randint(10, vocab, (long_len,), generator=g).tolist(),
                        params=long_params)]
    lo, hi = short_lens
    for i in range(num_short):
        n = int(torch.randint(lo, hi + 1, (1,), generator=g))
        arrivals.append(Arrival(request_id=f"short-{i}", at=(i + 0.5) / num_short * 0.9 * window_s,
                                prompt=torch.randint(10, vocab, (n,), generator=g).tolist(),
                                params=short_params))
    return arrivals


def parse_pairs(text: str | None) -> list[tuple[int, int]]:
    """``"768:1024,1536:2048"`` as ``[(768, 1024), (1536, 2048)]`` (threshold, budget).

    Raises
    ------
    click.BadParameter
        An entry that is not ``THRESHOLD:BUDGET`` of positive integers with the threshold at
        most the budget.
    """
    out: list[tuple[int, int]] = []
    for item in (text or "").split(","):
        if not item.strip():
            continue
        parts = item.split(":")
        try:
            thr, budget = (int(x) for x in parts)
        except ValueError:
            raise click.BadParameter(
                f"{item!r} is not THRESHOLD:BUDGET (two integers, e.g. 768:1024)",
                param_hint="--pairs") from None
        if not 0 < thr <= budget:
            raise click.BadParameter(
                f"{item!r}: need 0 < threshold <= budget (a chunk must fit in a step)",
                param_hint="--pairs")
        out.append((thr, budget))
    return out


def summarize(runs: list[list[Any]]) -> dict[str, Any]:
    """Short-request TTFT/ITL percentiles (pooled) and the long request's median times.

    Parameters
    ----------
    runs:
        One list of `pagedcore.bench.timeline.Trace` per repetition, the long request first.
    """
    from pagedcore.bench.report import percentiles

    ttft = [t.ttft for run in runs for t in run[1:] if t.ttft is not None]
    itl = [x for run in runs for t in run[1:] for x in t.itls]
    longs = [run[0] for run in runs]
    return {
        "short_ttft_s": percentiles(ttft),
        "short_itl_s": percentiles(itl),
        "long_completion_s": statistics.median(t.latency for t in longs),
        "long_ttft_s": statistics.median(t.ttft for t in longs),
        "long_completion_all_s": [t.latency for t in longs],
        "unfinished": sum(t.finished is None or t.error is not None for r in runs for t in r),
    }


def apply_config(llm: Any, config: dict[str, Any]) -> None:
    """Switch `llm`'s scheduler limits to `config` (keys of `SchedulerConfig`) between runs.

    One engine serves every configuration of the experiment: it is built with the largest
    budget, so its input buffers and CUDA-graph token buckets cover every step a smaller
    budget can produce, and a step of ``n`` tokens replays the same bucket a fresh engine
    would (buckets below a budget do not depend on it). Only the scheduler's limits change.

    Raises
    ------
    ValueError
        A budget above the one the engine was built with (its buffers would not fit).
    """
    import attrs

    built = llm.runner.max_num_batched_tokens
    budget = config.get("max_num_batched_tokens", llm.scheduler.config.max_num_batched_tokens)
    if budget > built:
        raise ValueError(
            f"max_num_batched_tokens={budget} exceeds the {built} the engine was built with; "
            "build the engine with the largest budget of the sweep"
        )
    new = attrs.evolve(llm.scheduler.config, **config)
    llm.scheduler.config = new
    llm.scheduler_config = new


def run_config(llm: Any, arrivals: list[Any], *, reps: int, clock_factory: Any,
               warmup_reps: int = 1) -> dict[str, Any]:
    """Run the timeline ``warmup_reps`` times untimed (any kernel shape first met here is
    compiled outside the figures), then `reps` times, and summarize.

    Besides `summarize`'s figures: the last repetition's step count, its largest step, the
    steps up to the long request's first token, and how many shorts arrived before it.
    """
    from pagedcore.bench.timeline import Arrival, run_timeline

    runs = []
    steps: list[Any] = []
    for rep in range(warmup_reps + reps):
        renamed = [Arrival(request_id=f"{a.request_id}@{rep}", at=a.at, prompt=a.prompt,
                           params=a.params) for a in arrivals]
        traces, steps = run_timeline(llm, renamed, clock=clock_factory())
        if rep >= warmup_reps:
            runs.append(traces)
    summary = summarize(runs)
    last = runs[-1]
    long_first = last[0].token_times[0] if last[0].token_times else None
    summary["steps_last_rep"] = len(steps)
    summary["max_step_tokens_last_rep"] = max((s.num_tokens for s in steps), default=0)
    summary["long_prefill_steps_last_rep"] = (
        None if long_first is None else sum(s.end <= long_first for s in steps))
    summary["shorts_arriving_during_long_prefill_last_rep"] = (
        None if long_first is None else sum(t.arrival < long_first for t in last[1:]))
    # Each step of the last repetition: start and end (ms since the start) and tokens.
    summary["step_trace_last_rep"] = [
        [round(s.start * 1e3, 3), round(s.end * 1e3, 3), s.num_tokens] for s in steps]
    return summary


def _plot(report: dict[str, Any], path: str) -> None:
    from pagedcore.bench.report import save_figure, subplots

    def order(row: dict[str, Any]) -> tuple[int, int]:
        cfg = row["engine_config"]
        if not cfg["enable_chunked_prefill"]:
            return (0, 0)
        thr = cfg["long_prefill_token_threshold"]
        if thr is None:
            return (2, cfg["max_num_batched_tokens"])
        return (3, thr) if ", mnbt=" in row["label"] else (1, thr)

    rows = sorted(report["configs"], key=order)
    labels = [r["label"] for r in rows]
    xs = list(range(len(rows)))
    fig, (a1, a2, a3) = subplots(3, width=5.2, height=4.4)
    for key, ax, title in (("short_ttft_s", a1, "short requests: TTFT"),
                           ("short_itl_s", a3, "short requests: inter-token latency")):
        for q, marker in (("p50", "o"), ("p95", "s"), ("p99", "^")):
            ax.plot(xs, [r[key][q] * 1e3 for r in rows], marker, label=q)
        ax.set_yscale("log")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.legend(fontsize=8)
    a2.bar(xs, [r["long_completion_s"] for r in rows], color="tab:gray")
    base = rows[0]["long_completion_s"]
    a2.axhline(base * 1.1, color="tab:red", lw=0.8, ls="--", label="no chunking + 10%")
    a2.set_ylabel("s")
    a2.set_title(f"long request ({report['workload']['long_prompt_tokens']:,} tokens): completion")
    a2.legend(fontsize=8)
    for ax in (a1, a2, a3):
        ax.set_xticks(xs, labels, rotation=60, ha="right", fontsize=7)
    env = report["environment"]
    save_figure(fig, path, caption=f"{env['device']} · backend {report['backend']} · "
                f"commit {env['git_commit']} · mnbt = max_num_batched_tokens, thr = "
                "long_prefill_token_threshold")


@click.command()
@click.option("--small", is_flag=True, help="Tiny model, 8K-token long prompt (CPU-friendly).")
@click.option("--device", default=None, type=DEVICE,
              help="cpu or cuda (default: cuda when available).")
@click.option("--backend", default=None, type=BACKEND, help="Force an attention backend.")
@click.option("--model", "model_name", default="qwen2-0.5b", show_default=True,
              type=click.Choice(["qwen2-0.5b", "llama3-8b"]),
              help="Model shape (seeded random weights); with --small a tiny model of the "
                   "same architecture.")
@click.option("--long-len", default=None, type=positive_int(), help="Long prompt tokens.")
@click.option("--reps", default=None, type=positive_int(),
              help="Timed repetitions per configuration.")
@click.option("--budgets", default=None, type=IntList(1),
              help="Comma list of max_num_batched_tokens to sweep.")
@click.option("--thresholds", default=None, type=IntList(1),
              help="Comma list of long_prefill_token_threshold to sweep.")
@click.option("--pairs", default=None, callback=lambda _ctx, _p, v: (parse_pairs(v), v)[1],
              help="Comma list of THRESHOLD:BUDGET pairs run as well, after the thresholds "
                   "(e.g. 768:1024: 768-token chunks, steps capped at 1,024 tokens).")
@click.option("--unaligned", default=None, type=IntList(1),
              help="Comma list of long_prefill_token_threshold run again with bucket-aware "
                   "chunk alignment off (SchedulerConfig.token_buckets=None), after the pairs.")
@click.option("--json", "json_path", default=None, type=OutputPath())
@click.option("--plot", "plot_path", default=None, type=OutputPath())
def chunked(small: bool, device: str | None, backend: str | None, model_name: str,
            long_len: int | None, reps: int | None, budgets: list[int] | None,
            thresholds: list[int] | None, pairs: str | None, json_path: str | None,
            plot_path: str | None, unaligned: list[int] | None = None) -> None:
    """Chunked prefill: short-request TTFT/ITL and long completion vs no chunking."""
    import torch

    from pagedcore.bench.report import (
        build_bench_model,
        device_memory,
        engine_bench_model,
        environment,
        model_shape,
        write_json,
    )
    from pagedcore.bench.timeline import Arrival, WallClock, run_timeline
    from pagedcore.engine.llm import LLM
    from pagedcore.engine.sampling.sampling_params import SamplingParams

    dev, dtype, config = engine_bench_model(small, device, model_name)
    if small:
        long_len = long_len or 8192
        budget_list, threshold_list = [256, 512, 1024, 2048], [256, 512, 1024, 2048]
        short_max = 8
    else:
        long_len = long_len or 32768
        # Room for the 32K prompt plus its output (Qwen2-0.5B's own limit is 32,768).
        dev, dtype, config = engine_bench_model(
            small, device, model_name, max_position_embeddings=max(32768, long_len + 256))
        budget_list = [1024, 2048, 4096, 8192]
        threshold_list = [512, 1024, 1536, 2048, 3072, 4096, 8192]
        short_max = 32
    if budgets:
        budget_list = list(budgets)
    if thresholds:
        threshold_list = list(thresholds)
    pair_list = parse_pairs(pairs)
    reps = reps or (1 if small else 3)
    vocab = int(config.vocab_size)
    max_model_len = long_len + 256
    common: dict[str, Any] = dict(
        block_size=16, max_model_len=max_model_len, max_num_seqs=64,
        enable_prefix_caching=False,
        kv_cache_memory_bytes=(1 << 30) if dev.type == "cpu" else (16 << 30),
    )
    sync = torch.cuda.synchronize if dev.type == "cuda" else None

    def clock() -> Any:
        return WallClock(sync)

    configs: list[tuple[str, dict[str, Any]]] = [
        ("no chunking", dict(enable_chunked_prefill=False, max_num_batched_tokens=max_model_len,
                             long_prefill_token_threshold=None))]
    # Thresholds first: they are what lets short requests in (a budget alone does not).
    configs += [(f"thr={t} (mnbt={max_model_len})",
                 dict(enable_chunked_prefill=True, max_num_batched_tokens=max_model_len,
                      long_prefill_token_threshold=t)) for t in threshold_list]
    # Both at once (off the one-variable sweep): a chunk size and a step cap above it.
    configs += [(f"thr={t}, mnbt={b}", dict(enable_chunked_prefill=True, max_num_batched_tokens=b,
                                            long_prefill_token_threshold=t))
                for t, b in pair_list]
    configs += [(f"thr={int(t)} unaligned (mnbt={max_model_len})",
                 dict(enable_chunked_prefill=True, max_num_batched_tokens=max_model_len,
                      long_prefill_token_threshold=int(t), token_buckets=None))
                for t in (unaligned or [])]
    configs += [(f"mnbt={b}", dict(enable_chunked_prefill=True, max_num_batched_tokens=b,
                                   long_prefill_token_threshold=None)) for b in budget_list]
    # One engine, built with the largest budget; `apply_config` switches the limits.
    largest = max([max_model_len, *budget_list, *(b for _, b in pair_list)])
    model, init_s = build_bench_model(config, dtype=dtype, device=dev, seed=0)
    click.echo(f"model {model_name}{' (small)' if small else ''}: random weights built on "
               f"{dev} in {init_s:.1f} s", err=True)
    llm = LLM(model, device=dev, dtype=dtype, backend=backend,
              max_num_batched_tokens=largest, **common)
    del model
    # Bucket-aware chunk alignment as built (None: off); rows without a token_buckets key use it.
    aligned = llm.scheduler.config.token_buckets
    click.echo(f"engine built: {llm.cudagraph_status()}; chunk alignment buckets {aligned}",
               err=True)
    g = torch.Generator().manual_seed(123)
    warmup = [torch.randint(10, vocab, (n,), generator=g).tolist()
              for n in (96, min(1024, long_len))]
    two = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    run_timeline(llm, [Arrival(request_id=f"warm-{i}", at=0.0, prompt=p, params=two)
                       for i, p in enumerate(warmup)], clock=clock())

    # Calibrate the arrival window: the long prompt's unchunked prefill alone, measured twice
    # (the first run compiles whatever the long eager step needs); the second run counts.
    apply_config(llm, configs[0][1])
    probe = make_timeline(long_len=long_len, num_short=0, short_lens=(64, 160),
                          short_max_tokens=short_max, long_max_tokens=1, window_s=0.0,
                          vocab=vocab, seed=1)
    calib = run_config(llm, probe, reps=1, warmup_reps=1, clock_factory=clock)
    window = float(calib["long_completion_s"])
    click.echo(f"arrival window (unchunked prefill of {long_len} tokens): {window * 1e3:.1f} ms",
               err=True)
    arrivals = make_timeline(long_len=long_len, num_short=20, short_lens=(64, 160),
                             short_max_tokens=short_max, long_max_tokens=short_max,
                             window_s=window, vocab=vocab, seed=1)
    rows: list[dict[str, Any]] = []
    report: dict[str, Any] = {
        "experiment": "chunked prefill",
        "environment": environment(dev),
        "model": {**model_shape(config, dtype=dtype, kv_dtype=dtype,
                                name=model_name + (" (small)" if small else "")),
                  "init_seconds": init_s},
        "backend": ",".join(sorted(set(llm.backend_names))),
        "cudagraph": llm.cudagraph_status(),
        "workload": {
            "long_prompt_tokens": long_len, "long_max_tokens": short_max,
            "num_short": 20, "short_prompt_tokens": [64, 160], "short_max_tokens": short_max,
            "arrival_window_s": window,
            "calibration_runs_s": calib["long_completion_all_s"],
            "arrivals_s": [a.at for a in arrivals],
            "calibration": "window = unchunked prefill time of the long prompt alone "
                           "(max_tokens=1, warm engine, second of two runs); shorts at "
                           "(i+0.5)/20*0.9*window",
        },
        "warmup": f"engine: 2 requests ({[len(p) for p in warmup]} tokens, max_tokens=2); "
                  "per configuration: one untimed repetition of the whole timeline",
        "repetitions": reps,
        "engine": "one engine for every configuration, built with max_num_batched_tokens="
                  f"{largest}; the scheduler limits are switched between "
                  "configurations (pagedcore.bench.chunked.apply_config)",
        "engine_config_common": common,
        "token_buckets": aligned,
        "complete": False,
        "configs": rows,
    }
    for label, cfg in configs:
        cfg = {"token_buckets": aligned, **cfg}
        apply_config(llm, cfg)
        summary = run_config(llm, arrivals, reps=reps, clock_factory=clock)
        row: dict[str, Any] = {"label": label, "engine_config": {**common, **cfg}, **summary}
        base = rows[0] if rows else row
        row["short_ttft_p50_speedup_vs_no_chunking"] = (
            base["short_ttft_s"]["p50"] / row["short_ttft_s"]["p50"])
        row["long_completion_vs_no_chunking"] = (
            row["long_completion_s"] / base["long_completion_s"])
        rows.append(row)
        click.echo(f"KEY chunked {label}: short TTFT p50 "
                   f"{row['short_ttft_s']['p50'] * 1e3:.1f} ms "
                   f"({row['short_ttft_p50_speedup_vs_no_chunking']:.1f}x), long "
                   f"{row['long_completion_s'] * 1e3:.0f} ms "
                   f"({row['long_completion_vs_no_chunking']:.2f}x), "
                   f"{summary['long_prefill_steps_last_rep']} prefill steps, "
                   f"largest step {summary['max_step_tokens_last_rep']} tokens")
        report["device_memory"] = device_memory(dev)
        if json_path:  # after every configuration: a run cut short keeps what it measured
            write_json(json_path, report)
    report["complete"] = True
    report["cudagraph"] = llm.cudagraph_status()
    _print(report)
    if json_path:
        write_json(json_path, report)
        click.echo(f"wrote {json_path}")
    if plot_path:
        _plot(report, plot_path)
        click.echo(f"wrote {plot_path}")

def _print(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"chunked prefill ({report['environment']['device']}, "
                        f"{report['workload']['long_prompt_tokens']}-token long prompt)")
    for col in ("config", "TTFT p50/p95/p99 ms", "ITL p50/p95/p99 ms", "long s",
                "TTFT p50 gain", "long vs base"):
        table.add_column(col, justify="right")
    for r in report["configs"]:
        t, i = r["short_ttft_s"], r["short_itl_s"]

        def fmt(p: dict[str, Any]) -> str:
            if p["p50"] is None:
                return "-"
            return f"{p['p50'] * 1e3:.1f}/{p['p95'] * 1e3:.1f}/{p['p99'] * 1e3:.1f}"

        table.add_row(r["label"], fmt(t), fmt(i), f"{r['long_completion_s']:.2f}",
                      f"{r['short_ttft_p50_speedup_vs_no_chunking']:.1f}x",
                      f"{r['long_completion_vs_no_chunking']:.2f}")
    Console(width=160).print(table)
