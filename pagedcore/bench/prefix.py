"""`pagedcore bench prefix`: what prefix caching buys on time to first token.

Three parts, on one engine with prefix caching on (and the chat trace once more with it off):

1. warm-up on unrelated requests of every prompt length used (allocator and kernel shapes warm,
   and the cache holds unrelated blocks, as on a server that has been running);
2. shared system prompts of several lengths: per length, ``reps`` cold requests (a fresh system
   prompt each time, so nothing can hit) and ``reps`` warm requests (the same system prompt as a
   priming request, a different user turn each), all with ``max_tokens=1`` so TTFT is prefill;
   every request's ``num_cached_tokens`` is recorded and checked, so hits are proven;
3. a multi-turn chat trace in which each turn's prompt is the full history (system prompt, all
   earlier user turns and the engine's own replies) plus a new user turn.

Requests run one at a time through the arrival-timeline driver (`pagedcore.bench.timeline`).
After the figures are saved, ``--phases`` (default) breaks cold and warm requests down by
engine phase (`pagedcore.bench.prefix_phases`: where a warm request's time goes) and
``--profile-dir`` adds `torch.profiler` tables of one cold and one warm request per length.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import click

from pagedcore.cli_progress import progress_bar
from pagedcore.cli_types import IntList, OutputPath, positive_int
from pagedcore.engine.engine_args_cli import engine_options

__all__ = ["chat_trace", "measure_phases", "measure_prefix", "prefix", "profile_phases"]


def _tokens(n: int, *, vocab: int, seed: int) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (n,), generator=g).tolist()


def _one(llm: Any, rid: str, prompt: list[int], max_tokens: int, clock: Any = None) -> Any:
    """Run one request alone through the timeline driver; its `Trace`."""
    from pagedcore.bench.timeline import Arrival, run_timeline
    from pagedcore.engine.sampling.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    traces, _ = run_timeline(
        llm, [Arrival(request_id=rid, at=0.0, prompt=prompt, params=params)], clock=clock
    )
    if traces[0].error is not None:
        raise RuntimeError(f"request {rid} failed: {traces[0].error}")
    return traces[0]


def measure_prefix(llm: Any, *, lengths: list[int], reps: int, user_len: int, vocab: int,
                   clock: Any = None) -> list[dict[str, Any]]:
    """Cold vs warm TTFT per system-prompt length (requests with ``max_tokens=1``)."""
    block = llm.kv_cache_config.groups[0].spec.block_size
    rows = []
    for li, length in enumerate(lengths):
        shared = _tokens(length, vocab=vocab, seed=1000 + li)
        cold, warm = [], []
        for r in range(reps):
            fresh = _tokens(length, vocab=vocab, seed=2000 + 100 * li + r)
            user = _tokens(user_len, vocab=vocab, seed=3000 + 100 * li + r)
            trace = _one(llm, f"cold-{length}-{r}", fresh + user, 1, clock)
            cold.append(trace)
        prime = _one(llm, f"prime-{length}", shared + _tokens(user_len, vocab=vocab,
                                                                 seed=4000 + li), 1, clock)
        for r in range(reps):
            user = _tokens(user_len, vocab=vocab, seed=5000 + 100 * li + r)
            trace = _one(llm, f"warm-{length}-{r}", shared + user, 1, clock)
            warm.append(trace)
        expected_hit = (length // block) * block
        cold_ttft = statistics.median(t.ttft for t in cold)
        warm_ttft = statistics.median(t.ttft for t in warm)
        rows.append({
            "system_prompt_tokens": length,
            "user_tokens": user_len,
            "cold_ttft_s": [t.ttft for t in cold],
            "warm_ttft_s": [t.ttft for t in warm],
            "cold_num_cached_tokens": [t.num_cached_tokens for t in cold],
            "warm_num_cached_tokens": [t.num_cached_tokens for t in warm],
            "prime_num_cached_tokens": prime.num_cached_tokens,
            "expected_warm_hit_tokens": expected_hit,
            "hits_proven": all(t.num_cached_tokens == 0 for t in cold)
            and all((t.num_cached_tokens or 0) >= expected_hit for t in warm),
            "cold_ttft_median_s": cold_ttft,
            "warm_ttft_median_s": warm_ttft,
            "speedup": cold_ttft / warm_ttft if warm_ttft > 0 else None,
        })
    return rows


def _collector(echo: Any) -> tuple[list[dict[str, Any]], Any]:
    """A row list and an ``add(row)`` that also echoes the row as one line."""
    from pagedcore.bench.prefix_phases import format_breakdown

    rows: list[dict[str, Any]] = []

    def add(row: dict[str, Any]) -> None:
        rows.append(row)
        if echo is not None:
            echo(f"PHASES {format_breakdown(row)} cached {row['num_cached_tokens']} "
                 f"replays {row['mixed_graph_replays']}" if "phases_ms" in row
                 else f"PROFILE {row}")

    return rows, add


def measure_phases(llm: Any, *, lengths: list[int], user_len: int, vocab: int,
                   sync: Any = None, reps: int = 3, echo: Any = None) -> list[dict[str, Any]]:
    """Per-phase breakdown (`pagedcore.bench.prefix_phases`) of cold and warm requests with
    ``max_tokens=1`` per length, and of warm requests with ``max_tokens=2`` (one decode
    step more) at the first length. `echo` (e.g. ``print``) gets a line per row as soon as
    it is measured."""
    from pagedcore.bench.prefix_phases import phase_breakdown

    rows, add = _collector(echo)

    shared = {n: _tokens(n, vocab=vocab, seed=8000 + li) for li, n in enumerate(lengths)}
    for li, length in enumerate(lengths):
        cold = [_tokens(length + user_len, vocab=vocab, seed=8100 + 10 * li + r)
                for r in range(reps)]
        add({"system_prompt_tokens": length,
             **phase_breakdown(llm, cold, label=f"cold-{length}", sync=sync)})
        warm = [shared[length] + _tokens(user_len, vocab=vocab, seed=8200 + 10 * li + r)
                for r in range(reps + 1)]
        # The first warm prompt primes the cache (it is cold itself); the rest hit it.
        phase_breakdown(llm, warm[:1], label=f"prime-{length}", sync=sync)
        add({"system_prompt_tokens": length,
             **phase_breakdown(llm, warm[1:], label=f"warm-{length}", sync=sync)})
        if li == 0:
            more = [shared[length] + _tokens(user_len, vocab=vocab, seed=8300 + r)
                    for r in range(reps)]
            add({"system_prompt_tokens": length,
                 **phase_breakdown(llm, more, label=f"warm-{length}-2tok", sync=sync,
                                   max_tokens=2)})
    return rows


def profile_phases(llm: Any, *, lengths: list[int], user_len: int, vocab: int,
                   profile_dir: str, echo: Any = None) -> list[dict[str, Any]]:
    """One warm (after `measure_phases` primed its prefix) and one cold request per length
    under `torch.profiler`; the tables are written to `profile_dir`."""
    import os

    from pagedcore.bench.prefix_phases import profile_request

    os.makedirs(profile_dir, exist_ok=True)
    rows, add = _collector(echo)
    for li, length in enumerate(lengths):
        shared = _tokens(length, vocab=vocab, seed=8000 + li)
        for kind, prompt in (
            ("warm", shared + _tokens(user_len, vocab=vocab, seed=8400 + li)),
            ("cold", _tokens(length + user_len, vocab=vocab, seed=8500 + li)),
        ):
            name = f"profile-{kind}-{length}"
            add({"system_prompt_tokens": length, **profile_request(
                llm, prompt, os.path.join(profile_dir, f"{name}.txt"), label=name)})
    return rows


def chat_trace(llm: Any, *, turns: int, system_len: int, user_len: int, reply_len: int,
               vocab: int, prefix: str, clock: Any = None) -> list[dict[str, Any]]:
    """A multi-turn chat where each turn's prompt carries the full history."""
    from pagedcore.bench.timeline import Arrival, run_timeline
    from pagedcore.engine.sampling.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=reply_len, temperature=0.0, ignore_eos=True)
    history = _tokens(system_len, vocab=vocab, seed=7000)
    rows = []
    for turn in range(turns):
        prompt = history + _tokens(user_len, vocab=vocab, seed=7100 + turn)
        rid = f"{prefix}-turn-{turn}"
        replies: dict[str, list[int]] = {}
        arrivals = [Arrival(request_id=rid, at=0.0, prompt=prompt, params=params)]
        traces, _ = run_timeline(llm, arrivals, clock=clock, outputs=replies)
        trace = traces[0]
        rows.append({
            "turn": turn,
            "prompt_tokens": len(prompt),
            "num_cached_tokens": trace.num_cached_tokens,
            "ttft_s": trace.ttft,
            "latency_s": trace.latency,
        })
        history = prompt + replies[rid]
    return rows


def _plot(report: dict[str, Any], path: str) -> None:
    from pagedcore.bench.report import save_figure, subplots

    fig, (ax1, ax2) = subplots(2)
    rows = report["shared_system_prompt"]
    xs = range(len(rows))
    cold = [r["cold_ttft_median_s"] * 1e3 for r in rows]
    warm = [r["warm_ttft_median_s"] * 1e3 for r in rows]
    ax1.bar([x - 0.2 for x in xs], cold, 0.4, label="cold (unique prefix)")
    ax1.bar([x + 0.2 for x in xs], warm, 0.4, label="warm (shared prefix cached)")
    for x, r in zip(xs, rows, strict=True):
        ax1.annotate(f"{r['speedup']:.1f}x", (x + 0.2, r["warm_ttft_median_s"] * 1e3),
                     ha="center", va="bottom", fontsize=8)
    ax1.set_xticks(list(xs), [f"{r['system_prompt_tokens']:,}" for r in rows])
    ax1.set_yscale("log")
    ax1.set_xlabel("system prompt tokens")
    ax1.set_ylabel("TTFT, ms (median, max_tokens=1)")
    ax1.set_title("shared system prompt")
    ax1.legend(fontsize=8)
    on, off = report["chat_trace"]["caching_on"], report["chat_trace"]["caching_off"]
    turns = [r["turn"] for r in on]
    ax2.plot(turns, [r["ttft_s"] * 1e3 for r in off], "o-", label="prefix caching off")
    ax2.plot(turns, [r["ttft_s"] * 1e3 for r in on], "o-", label="prefix caching on")
    ax2.set_xlabel("turn (prompt = full history + new user turn)")
    ax2.set_ylabel("TTFT, ms")
    ax2.set_yscale("log")
    ax2.set_title("multi-turn chat")
    twin = ax2.twinx()
    twin.bar(turns, [r["num_cached_tokens"] / r["prompt_tokens"] for r in on], 0.5,
             color="0.85", zorder=0)
    twin.set_ylim(0, 1)
    twin.set_ylabel("cached fraction of prompt (bars, caching on)")
    ax2.set_zorder(twin.get_zorder() + 1)
    ax2.patch.set_visible(False)
    ax2.legend(fontsize=8, loc="upper left")
    env = report["environment"]
    save_figure(fig, path, caption=f"{env['device']} · backend {report['backend']} · "
                f"commit {env['git_commit']}")


@click.command()
@click.option("--small", is_flag=True, help="Tiny model, CPU-friendly lengths (1K/4K/8K).")
@click.option("--model", "model_name", default="qwen2-0.5b", show_default=True,
              type=click.Choice(["qwen2-0.5b", "llama3-8b"]),
              help="Model shape (seeded random weights); with --small a tiny model of the "
                   "same architecture.")
@click.option("--lengths", default=None, type=IntList(1),
              help="Comma list of system-prompt lengths.")
@click.option("--reps", default=None, type=positive_int(),
              help="Cold and warm requests per length.")
@click.option("--json", "json_path", default=None, type=OutputPath(),
              help="Write the figures to this JSON file.")
@click.option("--plot", "plot_path", default=None, type=OutputPath(),
              help="Write the plot to this image file (png, svg, ...).")
@click.option("--phases/--no-phases", default=True, show_default=True,
              help="Also break cold and warm requests down by engine phase (synced).")
@click.option("--shared-decode", is_flag=True,
              help="Also run the shared-prefix decode workload (64 requests x 4,096 shared + "
                   "256 own tokens; --small: 8 x 512 + 32), cascade attention off vs on.")
@click.option("--shared-decode-only", is_flag=True,
              help="Run only the shared-prefix decode workload (one engine, warmed at "
                   "--lengths; default 4096), not the cold/warm TTFT figures or the chat "
                   "trace.")
@click.option("--profile-dir", default=None, type=click.Path(file_okay=False),
              help="With --phases: also profile one cold and one warm request per length "
                   "(torch.profiler tables written here).")
@engine_options(model=None, overrides=True, exclude=("enable_prefix_caching",))
def prefix(small: bool, model_name: str, lengths: list[int] | None,
           reps: int | None, json_path: str | None, plot_path: str | None,
           phases: bool, shared_decode: bool, shared_decode_only: bool,
           profile_dir: str | None, engine_overrides: dict[str, Any]) -> None:
    """Prefix caching: cold vs warm TTFT at shared system prompts, and a multi-turn chat.

    The engine options given apply to both engines (prefix caching on and off)."""
    import torch

    from pagedcore.bench.report import (
        build_bench_model,
        device_memory,
        engine_bench_model,
        environment,
        model_shape,
        with_overrides,
        write_json,
    )
    from pagedcore.bench.timeline import WallClock
    from pagedcore.engine.llm import LLM

    if small:
        lens = [1024, 4096, 8192]
    else:
        lens = [1024, 4096, 16384]
    if shared_decode_only:
        lens = [512] if small else [4096]
    if lengths:
        lens = list(lengths)
    decode_shape: dict[str, Any] = dict(num_reqs=8, shared=512, own=32, max_tokens=8) if small \
        else dict(num_reqs=64, shared=4096, own=256, max_tokens=48, reps=3)
    # The engine must hold a shared-decode request (prompt + generated tokens) too.
    longest = max(lens) + 1024
    if shared_decode or shared_decode_only:
        longest = max(longest, decode_shape["shared"] + decode_shape["own"]
                      + decode_shape["max_tokens"] + 64)
    device, backend = engine_overrides.get("device"), engine_overrides.get("backend")
    dev, dtype, config = engine_bench_model(small, device, model_name,
                                            dtype=engine_overrides.get("dtype"))
    if int(config.max_position_embeddings) < longest:
        dev, dtype, config = engine_bench_model(small, device, model_name,
                                                max_position_embeddings=longest,
                                                dtype=engine_overrides.get("dtype"))
    reps = reps or (3 if small else 5)
    vocab = int(config.vocab_size)
    engine_cfg: dict[str, Any] = dict(
        block_size=16, max_model_len=longest, max_num_seqs=64,
        max_num_batched_tokens=4096 if small else 8192, enable_chunked_prefill=True,
        long_prefill_token_threshold=None,
        kv_cache_memory_bytes=(512 << 20) if dev.type == "cpu" else (16 << 30),
    )
    engine_cfg = with_overrides(engine_cfg, engine_overrides)
    engine_cfg.pop("backend", None)
    model, init_s = build_bench_model(config, dtype=dtype, device=dev, seed=0)
    click.echo(f"model {model_name}{' (small)' if small else ''}: random weights built on "
               f"{dev} in {init_s:.1f} s", err=True)
    sync = torch.cuda.synchronize if dev.type == "cuda" else None
    clock = WallClock(sync)
    chat = dict(turns=6, system_len=lens[0], user_len=128, reply_len=32)

    t0 = time.perf_counter()

    def progress(what: str) -> None:
        click.echo(f"[prefix +{time.perf_counter() - t0:.1f}s] {what}", err=True)

    report: dict[str, Any] = {
        "experiment": "prefix caching",
        "environment": environment(dev),
        "model": {**model_shape(config, dtype=dtype, kv_dtype=dtype,
                                name=model_name + (" (small)" if small else "")),
                  "init_seconds": init_s},
        "backend": None,
        "engine_config": {**engine_cfg, "enable_prefix_caching": True},
        "warmup": f"unrelated max_tokens=1 requests: for each length in {[*lens, 300]}, a "
                  "prompt of that length + 64 tokens, sent twice with different last 64 tokens "
                  "(cold and cache-hit paths both run)",
        "repetitions": reps,
        "timing": "TTFT = end of the step that sampled the first token - arrival; one "
                  "request at a time through the arrival-timeline driver; medians reported",
        "shared_system_prompt": [],
        "chat_trace": {"config": chat, "caching_on": None, "caching_off": None},
    }

    def save() -> None:
        report["device_memory"] = device_memory(dev)
        if json_path:
            write_json(json_path, report)
            click.echo(f"wrote {json_path}")

    def engine(caching: bool) -> Any:
        # The caching-on engine gets a copy, the last one (caching off) the model itself.
        built = LLM(copy.deepcopy(model) if caching else model, device=dev, dtype=dtype,
                    backend=backend, enable_prefix_caching=caching, **engine_cfg)
        progress(f"engine built (prefix caching {'on' if caching else 'off'})")
        # Unrelated prompts of every length, each twice with different last 64 tokens, so
        # both the cold and the cache-hit code paths have run at every shape.
        for i, n in enumerate([*lens, 300]):
            head = _tokens(n, vocab=vocab, seed=90 + i)
            for j in range(2):
                tail = _tokens(64, vocab=vocab, seed=190 + 10 * i + j)
                _one(built, f"warmup-{caching}-{i}-{j}", head + tail, 1, clock)
        progress("warm-up done")
        return built

    # The headline (cold vs warm) first, saved at once: a run cut short keeps it.
    advance = click.get_current_context().with_resource(
        progress_bar("bench prefix", 3))
    llm = engine(True)
    report["backend"] = ",".join(sorted(set(llm.backend_names)))
    report["cudagraphs"] = llm.runner.cudagraph_disabled_reason or "decode graphs in use"
    if shared_decode_only:
        _shared_decode(report, llm, decode_shape, vocab=vocab, sync=sync)
        save()
        return
    report["shared_system_prompt"] = measure_prefix(llm, lengths=lens, reps=reps, user_len=64,
                                                    vocab=vocab, clock=clock)
    for r in report["shared_system_prompt"]:
        print(f"KEY prefix {r['system_prompt_tokens']}: cold "
              f"{r['cold_ttft_median_s'] * 1e3:.2f} ms warm "
              f"{r['warm_ttft_median_s'] * 1e3:.2f} ms speedup {r['speedup']:.2f}x "
              f"hits_proven {r['hits_proven']}", flush=True)
    save()
    advance(1)
    if shared_decode:
        _shared_decode(report, llm, decode_shape, vocab=vocab, sync=sync)
        save()
    report["chat_trace"]["caching_on"] = chat_trace(llm, vocab=vocab, prefix="chat-True",
                                                    clock=clock, **chat)
    progress("chat trace (caching on) done")
    advance(1)
    off = engine(False)
    report["chat_trace"]["caching_off"] = chat_trace(off, vocab=vocab, prefix="chat-False",
                                                     clock=clock, **chat)
    del off
    progress("chat trace (caching off) done")
    advance(1)
    _print(report)
    save()
    if plot_path:
        _plot(report, plot_path)
        click.echo(f"wrote {plot_path}")
    # Diagnostics after the figures are saved (then saved again with them).
    if phases:
        report["phases"] = {
            "note": "per-phase medians (ms) of requests run alone, each phase closed by a "
                    "device sync (pagedcore.bench.prefix_phases); warm rows hit the cache",
            "rows": measure_phases(llm, lengths=lens, user_len=64, vocab=vocab, sync=sync,
                                   echo=print),
        }
        save()
        if profile_dir:
            report["phases"]["profiles"] = profile_phases(
                llm, lengths=lens, user_len=64, vocab=vocab, profile_dir=profile_dir,
                echo=print)
            save()


def _shared_decode(report: dict[str, Any], llm: Any, shape: dict[str, Any], *, vocab: int,
                   sync: Any) -> None:
    """The shared-prefix decode workload (cascade off vs on) into ``report``."""
    from pagedcore.bench.prefix_shared import measure_shared_decode

    row = measure_shared_decode(llm, vocab=vocab, sync=sync, **shape)
    report["shared_prefix_decode"] = row
    def rate(v: float | None, spec: str = ".0f") -> str:
        return "-" if v is None else format(v, spec)

    print(f"KEY shared-prefix decode {row['workload']}: cascade off "
          f"{rate(row['cascade_off']['decode_tokens_per_s'])} tok/s, on "
          f"{rate(row['cascade_on']['decode_tokens_per_s'])} tok/s "
          f"(x{rate(row['speedup'], '.2f')})", flush=True)


def _print(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"prefix caching ({report['environment']['device']}, "
                        f"backend {report['backend']})")
    for col in ("system prompt", "cold TTFT ms", "warm TTFT ms", "speedup", "warm cached",
                "hits proven"):
        table.add_column(col, justify="right")
    for r in report["shared_system_prompt"]:
        table.add_row(f"{r['system_prompt_tokens']:,}", f"{r['cold_ttft_median_s'] * 1e3:.1f}",
                      f"{r['warm_ttft_median_s'] * 1e3:.1f}", f"{r['speedup']:.1f}x",
                      str(r["warm_num_cached_tokens"]), str(r["hits_proven"]))
    Console().print(table)
    chat = Table(title="multi-turn chat (full history each turn)")
    for col in ("turn", "prompt", "cached (on)", "TTFT on ms", "TTFT off ms"):
        chat.add_column(col, justify="right")
    for on, off in zip(report["chat_trace"]["caching_on"], report["chat_trace"]["caching_off"],
                       strict=True):
        chat.add_row(str(on["turn"]), str(on["prompt_tokens"]), str(on["num_cached_tokens"]),
                     f"{on['ttft_s'] * 1e3:.1f}", f"{off['ttft_s'] * 1e3:.1f}")
    Console().print(chat)

