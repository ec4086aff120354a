"""`pagedcore bench serve`: a load generator against any OpenAI-compatible server.

Requests arrive as a Poisson process (or at a fixed rate) under an optional concurrency cap,
with prompt and output lengths drawn uniformly from ranges, optionally sharing a common prefix.
Each request streams; the client measures time to first token (TTFT), time per output token
after the first (TPOT), the gaps between chunks (ITL) and the end-to-end latency, and reports
p50 / p90 / p99 (numpy percentiles), request and token throughput, goodput under an SLO and the
errors. ``--request-rate 1,4,16,inf`` sweeps rates (one run each). Prompts are token ids by
default (``--prompt-kind ids``: any server that accepts token-id prompts, vLLM's included,
and models without a tokenizer) or random words (``text``, needed for ``--endpoint chat``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import random
from collections.abc import Sequence
from typing import Any

import click

from pagedcore.bench.serve_load import RequestResult, WorkItem, run_load
from pagedcore.cli_types import FiniteFloat, OutputPath

__all__ = ["RequestResult", "WorkItem", "make_workload", "run_load", "serve", "summarize"]

_WORDS = ("block", "table", "cache", "page", "token", "query", "key", "value", "batch", "step",
          "prefix", "decode", "prefill", "kernel", "head", "layer", "model", "engine", "slot",
          "window", "stream", "chunk", "graph", "shard")


def _parse_range(text: str, name: str, *, minimum: int = 1) -> tuple[int, int]:
    try:
        lo, _, hi = text.partition(":")
        low, high = int(lo), int(hi or lo)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not N or LO:HI", param_hint=name) from None
    if not minimum <= low <= high:
        raise click.BadParameter(f"{text!r}: need {minimum} <= LO <= HI", param_hint=name)
    return low, high


def _parse_rates(text: str) -> list[float]:
    rates = []
    for part in text.split(","):
        try:
            rate = float(part)
        except ValueError:
            raise click.BadParameter(f"{part!r} is not a number or 'inf'",
                                     param_hint="--request-rate") from None
        if not rate > 0:
            raise click.BadParameter(f"rates must be > 0, got {part!r}",
                                     param_hint="--request-rate")
        rates.append(rate)
    return rates


def make_workload(
    num_requests: int,
    *,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int,
    prompt_kind: str = "ids",
    token_range: tuple[int, int] = (0, 250),
    shared_prefix_len: int = 0,
    shared_prefix_fraction: float = 0.0,
) -> list[WorkItem]:
    """The requests: lengths uniform in the ranges; a `shared_prefix_fraction` of them start
    with the same `shared_prefix_len` tokens (words for text prompts)."""
    rng = random.Random(seed)

    def piece(n: int) -> list[Any]:
        if prompt_kind == "ids":
            return [rng.randrange(*token_range) for _ in range(n)]
        return [rng.choice(_WORDS) for _ in range(n)]

    prefix = piece(shared_prefix_len)
    work = []
    for _ in range(num_requests):
        n_in = rng.randint(*input_len)
        shared = prefix if rng.random() < shared_prefix_fraction else []
        body = (shared + piece(max(0, n_in - len(shared))))[: max(n_in, 1)]
        prompt: str | list[int] = body if prompt_kind == "ids" else " ".join(body)
        work.append(WorkItem(prompt, len(body), rng.randint(*output_len)))
    return work


def _stats(values: Sequence[float]) -> dict[str, float | None]:
    from pagedcore.bench.report import percentiles

    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ms = [1000.0 * v for v in values]  # milliseconds
    found = percentiles(ms, (50, 90, 99))
    return {"mean": sum(ms) / len(ms), "p50": found["p50"], "p90": found["p90"],
            "p99": found["p99"]}


def _clock(results: Sequence[RequestResult]) -> dict[str, float | None]:
    """When (``time.perf_counter``, the system-wide monotonic clock on Linux) the run's first
    and last requests were sent and its first and last tokens arrived: to line the client up
    with the engine's step trace (`pagedcore.serve.step_trace`)."""
    sent = [r.start for r in results if r.start]
    first = [r.start + r.ttft for r in results if r.ok and r.ttft is not None]
    last = [r.start + r.e2e for r in results if r.ok and r.e2e is not None]
    return {"first_send": min(sent, default=None), "last_send": max(sent, default=None),
            "first_token": min(first, default=None), "last_token": max(last, default=None)}


def summarize(results: Sequence[RequestResult], duration: float, *,
              slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None,
              ) -> dict[str, Any]:
    """Throughput, latency percentiles (ms), goodput and errors of one run."""
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok
            if r.e2e is not None and r.ttft is not None and r.output_tokens > 1]
    good = 0
    for r in ok:
        t = r.ttft if r.ttft is not None else math.inf
        p = ((r.e2e or 0.0) - t) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
        if (slo_ttft_ms is None or 1000 * t <= slo_ttft_ms) and (
                slo_tpot_ms is None or 1000 * p <= slo_tpot_ms):
            good += 1
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    errors = [r.error for r in results if not r.ok]
    return {
        "completed": len(ok),
        "errors": len(errors),
        "error_samples": sorted(set(e for e in errors if e))[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
        "goodput": good / duration if duration else 0.0,
        "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms},
        "ttft_ms": _stats(ttft),
        "tpot_ms": _stats(tpot),
        "itl_ms": _stats([x for r in ok for x in r.itl]),
        "clock": _clock(results),
        "e2e_ms": _stats([r.e2e for r in ok if r.e2e is not None]),
    }


def _plot(runs: list[dict[str, Any]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise click.ClickException("--plot needs matplotlib: pip install matplotlib") from exc
    x = [r["summary"]["request_throughput"] for r in runs]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(x, [r["summary"]["output_throughput"] for r in runs], "o-")
    a.set_xlabel("achieved requests/s")
    a.set_ylabel("output tokens/s")
    for key, style in (("p50", "o-"), ("p99", "s--")):
        b.plot(x, [r["summary"]["ttft_ms"][key] for r in runs], style, label=f"TTFT {key}")
    b.plot(x, [r["summary"]["tpot_ms"]["p50"] for r in runs], "^-", label="TPOT p50")
    b.set_xlabel("achieved requests/s")
    b.set_ylabel("ms")
    b.set_yscale("log")
    b.legend()
    fig.suptitle("pagedcore bench serve")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _fetch_model(base_url: str, api_key: str | None) -> str:
    import httpx

    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
        resp.raise_for_status()
        return str(resp.json()["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise click.ClickException(
            f"cannot list the models of {base_url} ({exc}); is the server up? give --model"
        ) from exc


@click.command()
@click.option("--base-url", default="http://127.0.0.1:8000", show_default=True,
              help="The server (OpenAI-compatible: /v1/completions, /v1/chat/completions).")
@click.option("--model", default=None, help="Model name to send (default: the server's first).")
@click.option("--endpoint", type=click.Choice(["completions", "chat"]), default="completions",
              help="Which OpenAI endpoint to send to: /v1/completions or /v1/chat/completions.",
              show_default=True)
@click.option("--num-requests", default=100, show_default=True, type=click.IntRange(min=1),
              help="Requests to send.")
@click.option("--request-rate", default="inf", show_default=True,
              help="Requests/s (comma list to sweep; inf = all at once).")
@click.option("--arrival", type=click.Choice(["poisson", "fixed"]), default="poisson",
              show_default=True, help="Arrival process at a finite rate.")
@click.option("--max-concurrency", default=None, type=click.IntRange(min=1),
              help="Requests in flight at most (default: no cap).")
@click.option("--input-len", default="128:1024", show_default=True,
              help="Prompt tokens: N or LO:HI (uniform).")
@click.option("--output-len", default="128:256", show_default=True,
              help="Output tokens: N or LO:HI (uniform).")
@click.option("--prompt-kind", type=click.Choice(["ids", "text"]), default="ids",
              show_default=True, help="Token-id prompts or random words.")
@click.option("--token-id-range", default="0:250", show_default=True,
              help="Token ids of id prompts are drawn from [LO, HI).")
@click.option("--shared-prefix-len", default=0, show_default=True, type=click.IntRange(min=0),
              help="Tokens of a prefix common to a fraction of the prompts.")
@click.option("--shared-prefix-fraction", default=0.0, show_default=True,
              type=FiniteFloat(0.0, 1.0), help="Fraction of prompts with that prefix.")
@click.option("--ignore-eos/--no-ignore-eos", default=True, show_default=True,
              help="Send ignore_eos so outputs have the requested lengths.")
@click.option("--slo-ttft-ms", default=None, type=float, help="Goodput SLO on TTFT.")
@click.option("--slo-tpot-ms", default=None, type=float, help="Goodput SLO on TPOT.")
@click.option("--api-key", default=None, envvar="OPENAI_API_KEY",
              help="Bearer token to send (env OPENAI_API_KEY).")
@click.option("--timeout", default=600.0, show_default=True, help="Seconds per request.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0),
              help="Seed of the arrivals and the prompts.")
@click.option("--json", "json_path", default=None, type=OutputPath(),
              help="Write the figures to this JSON file.")
@click.option("--plot", "plot_path", default=None, type=click.Path(dir_okay=False),
              help="Write throughput / latency vs rate (matplotlib).")
@click.option("--num-workers", default=1, show_default=True, type=click.IntRange(min=1),
              help="Client processes sharing the load (one Python client tops out at a few "
                   "tens of thousands of streamed tokens/s).")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def serve(base_url: str, model: str | None, endpoint: str, num_requests: int, request_rate: str,
          arrival: str, max_concurrency: int | None, input_len: str, output_len: str,
          prompt_kind: str, token_id_range: str, shared_prefix_len: int,
          shared_prefix_fraction: float, ignore_eos: bool, slo_ttft_ms: float | None,
          slo_tpot_ms: float | None, api_key: str | None, timeout: float, seed: int,
          json_path: str | None, plot_path: str | None, num_workers: int,
          no_progress: bool) -> None:
    """Load-test an OpenAI-compatible server (pagedcore serve, vLLM, ...) and report
    throughput, TTFT / TPOT / ITL / end-to-end percentiles, goodput and errors."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
    from rich.table import Table

    if endpoint == "chat" and prompt_kind == "ids":
        prompt_kind = "text"  # chat messages are text
    rates = _parse_rates(request_rate)
    lo, hi = _parse_range(token_id_range, "--token-id-range", minimum=0)
    if hi <= lo:
        raise click.BadParameter(f"{token_id_range!r}: need LO < HI",
                                 param_hint="--token-id-range")
    work = make_workload(num_requests, input_len=_parse_range(input_len, "--input-len"),
                         output_len=_parse_range(output_len, "--output-len"), seed=seed,
                         prompt_kind=prompt_kind, token_range=(lo, hi),
                         shared_prefix_len=shared_prefix_len,
                         shared_prefix_fraction=shared_prefix_fraction)
    name = model or _fetch_model(base_url, api_key)
    console = Console(stderr=True)
    runs: list[dict[str, Any]] = []
    for rate in rates:
        with Progress("[progress.description]{task.description}", BarColumn(),
                      MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                      transient=True, disable=no_progress) as bar:
            task = bar.add_task(f"rate {rate:g} req/s", total=len(work))
            if num_workers > 1:
                from pagedcore.bench.serve_workers import run_load_workers

                try:
                    results, duration = run_load_workers(
                        work, num_workers=num_workers, base_url=base_url, model=name,
                        endpoint=endpoint, request_rate=rate, arrival=arrival,
                        max_concurrency=max_concurrency, ignore_eos=ignore_eos,
                        api_key=api_key, timeout=timeout, seed=seed)
                except RuntimeError as exc:
                    raise click.ClickException(str(exc)) from exc
                bar.advance(task, len(work))
            else:
                results, duration = asyncio.run(run_load(
                work, base_url=base_url, model=name, endpoint=endpoint, request_rate=rate,
                arrival=arrival, max_concurrency=max_concurrency, ignore_eos=ignore_eos,
                    api_key=api_key, timeout=timeout, seed=seed,
                    progress=functools.partial(bar.advance, task)))
        summary = summarize(results, duration, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms)
        runs.append({"request_rate": rate if math.isfinite(rate) else "inf",
                     "summary": summary})
    table = Table(title=f"pagedcore bench serve: {name} at {base_url} ({num_requests} requests)")
    for col in ("rate", "ok / err", "req/s", "out tok/s", "TTFT p50/p99 ms", "TPOT p50/p99 ms",
                "ITL p99 ms", "e2e p50 ms", "goodput"):
        table.add_column(col, justify="right")

    def ms(d: dict[str, Any], key: str) -> str:
        return "-" if d[key] is None else f"{d[key]:.1f}"

    for run in runs:
        s = run["summary"]
        table.add_row(str(run["request_rate"]), f"{s['completed']} / {s['errors']}",
                      f"{s['request_throughput']:.2f}", f"{s['output_throughput']:.1f}",
                      f"{ms(s['ttft_ms'], 'p50')} / {ms(s['ttft_ms'], 'p99')}",
                      f"{ms(s['tpot_ms'], 'p50')} / {ms(s['tpot_ms'], 'p99')}",
                      ms(s["itl_ms"], "p99"), ms(s["e2e_ms"], "p50"), f"{s['goodput']:.2f}")
    Console().print(table)
    for run in runs:
        for sample in run["summary"]["error_samples"]:
            console.print(f"[red]error at rate {run['request_rate']}:[/red] {sample}")
    report = {
        "base_url": base_url, "model": name, "endpoint": endpoint,
        "num_requests": num_requests, "arrival": arrival, "max_concurrency": max_concurrency,
        "input_len": input_len, "output_len": output_len, "prompt_kind": prompt_kind,
        "shared_prefix_len": shared_prefix_len, "shared_prefix_fraction": shared_prefix_fraction,
        "ignore_eos": ignore_eos, "seed": seed, "num_workers": num_workers, "runs": runs,
    }
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(report, fh, indent=2)
    if plot_path:
        _plot(runs, plot_path)
