"""`pagedcore demo` and `pagedcore generate`."""

from __future__ import annotations

import json
import random
import time
from typing import Any

import click

from pagedcore.cli_types import BACKEND, DEVICE, FiniteFloat, OutputPath, positive_int
from pagedcore.engine.engine_args import EngineArgs
from pagedcore.engine.engine_args_cli import engine_options
from pagedcore.engine.stats_logging import configure_cli_logging

__all__ = ["demo", "generate", "synthetic_workload"]

_SYSTEM_PROMPTS = (
    "You are a helpful assistant. Answer briefly and precisely, and say when you do not know. ",
    "You are a paged-attention expert. Explain KV-cache blocks, block tables and slot mappings "
    "to engineers who know transformers but have never read the vLLM source code. ",
    "You translate English into French. Keep names, numbers and code unchanged; never add "
    "commentary; preserve line breaks exactly as they appear in the source text. ",
)
_QUESTIONS = (
    "What is a block table?",
    "Why does prefix caching help chat workloads with long shared system prompts?",
    "Summarise continuous batching in one sentence.",
    "Translate: the scheduler preempts the newest request when the cache is full.",
    "How does chunked prefill keep decode latency low while a very long document is being "
    "read into the cache, and what is the trade-off in time to first token?",
    "Hi!",
)


def synthetic_workload(num_requests: int, *, seed: int) -> list[tuple[str, int]]:
    """``(prompt, max_tokens)`` pairs: shared system prompts, a long/short mix of questions."""
    rng = random.Random(seed)
    work = []
    for i in range(num_requests):
        system = _SYSTEM_PROMPTS[i % len(_SYSTEM_PROMPTS)]
        question = rng.choice(_QUESTIONS)
        if rng.random() < 0.25:  # a long document now and then
            question = question + " Context: " + " ".join(rng.choice(_QUESTIONS)
                                                          for _ in range(rng.randint(3, 6)))
        work.append((system + question, rng.choice((8, 16, 32, 64))))
    return work


@click.command()
@click.option("--num-requests", default=64, show_default=True, type=positive_int(),
              help="Requests in the workload.")
@click.option("--device", default=None, type=DEVICE,
              help="cpu or cuda (default: cuda when available).")
@click.option("--backend", default=None, type=BACKEND, help="Force an attention backend by name.")
@click.option("--kv-cache-mb", default=4.0, show_default=True,
              type=FiniteFloat(min=0, min_open=True),
              help="KV-cache budget in MiB (small on purpose: shows preemption).")
@click.option("--max-num-batched-tokens", default=512, show_default=True, type=positive_int(),
              help="Tokens per engine step at most.")
@click.option("--seed", default=0, show_default=True, type=positive_int(0),
              help="Seed of the random weights, the workload and sampling.")
@click.option("--threads", default=1, show_default=True, type=positive_int(),
              help="torch CPU threads (the demo model is tiny: one is fastest).")
@click.option("--json", "json_path", default=None, type=OutputPath(),
              help="Write the summary figures to this JSON file.")
@click.option("--enforce-eager", is_flag=True,
              help="Never use CUDA graphs for decode steps (default: on where supported).")
def demo(num_requests: int, device: str | None, backend: str | None, kv_cache_mb: float,
         max_num_batched_tokens: int, seed: int, threads: int, json_path: str | None,
         enforce_eager: bool) -> None:
    """Serve a synthetic chat workload with the built-in model (no download) and summarise."""
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
    from rich.table import Table

    from pagedcore.bench.report import percentiles
    from pagedcore.engine.llm import LLM
    from pagedcore.engine.sampling.sampling_params import SamplingParams

    console = Console()
    if device == "cpu" or (device is None and not torch.cuda.is_available()):
        torch.set_num_threads(threads)
    try:
        llm = LLM("demo", device=device, max_model_len=1024, block_size=16,
                  max_num_batched_tokens=max_num_batched_tokens,
                  kv_cache_memory_bytes=int(kv_cache_mb * 2**20), backend=backend, seed=seed,
                  enforce_eager=enforce_eager)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    work = synthetic_workload(num_requests, seed=seed)
    params = [SamplingParams(max_tokens=m, temperature=0.8, top_p=0.95, seed=seed + i,
                             ignore_eos=True) for i, (_, m) in enumerate(work)]
    peak_usage = 0.0

    start = time.perf_counter()
    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        task = progress.add_task("generating", total=len(work))

        def on_step(outs: list[Any]) -> None:
            nonlocal peak_usage
            peak_usage = max(peak_usage, llm.kv_cache_manager.usage)
            progress.advance(task, sum(1 for o in outs if o.finished))

        outputs = llm.generate([w[0] for w in work], params, on_step=on_step)
    elapsed = time.perf_counter() - start

    stats = llm.stats()
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    ttft = [o.metrics.time_to_first_token or 0.0 for o in outputs]
    ttft_pct = percentiles(ttft, (50, 99))
    figures = {
        "model": "demo (Llama-like, 2 layers, hidden 128, heads 4/2 x 64, byte tokenizer, "
                 "random weights)",
        "device": str(llm.device),
        "dtype": str(llm.dtype).removeprefix("torch."),
        "backend": ", ".join(sorted(set(llm.backend_names))),
        "requests": len(outputs),
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated,
        "elapsed_s": elapsed,
        "output_tokens_per_s": generated / elapsed,
        "total_tokens_per_s": (generated + prompt_tokens) / elapsed,
        "ttft_p50_ms": 1000 * ttft_pct["p50"],
        "ttft_p99_ms": 1000 * ttft_pct["p99"],
        "prefix_hit_tokens": stats["prefix_hit_tokens"],
        "prefix_hit_rate": stats["prefix_hit_rate"],
        "preemptions": stats["preemptions"],
        "kv_blocks": stats["num_blocks"],
        "peak_kv_usage": peak_usage,
        "steps": stats["steps"],
        "cudagraph": stats["cudagraph"],
    }
    table = Table(title="pagedcore demo")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("backend", figures["backend"]),
        ("device / dtype", f"{figures['device']} / {figures['dtype']}"),
        ("requests", str(len(outputs))),
        ("prompt / generated tokens", f"{prompt_tokens} / {generated}"),
        ("wall time", f"{elapsed:.2f} s"),
        ("output throughput", f"{figures['output_tokens_per_s']:.1f} tok/s"),
        ("total throughput", f"{figures['total_tokens_per_s']:.1f} tok/s"),
        ("TTFT p50 / p99", f"{figures['ttft_p50_ms']:.0f} / {figures['ttft_p99_ms']:.0f} ms"),
        ("prefix-hit tokens", f"{stats['prefix_hit_tokens']} ({100 * stats['prefix_hit_rate']:.0f}%"
                              " of prompt tokens)"),
        ("preemptions", str(stats["preemptions"])),
        ("KV blocks / peak usage", f"{stats['num_blocks']} / {100 * peak_usage:.0f}%"),
        ("engine steps", str(stats["steps"])),
        ("CUDA graphs (decode)", "on" if stats["cudagraph"]["enabled"]
         else f"off ({stats['cudagraph']['reason']})"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    sample = outputs[0].outputs[0].text
    console.print(f"[dim]first output (random weights, so bytes are noise): {sample[:60]!r}[/dim]")
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(figures, fh, indent=2)


@click.command()
@click.option("--prompt", "prompts", multiple=True, help="Prompt text (repeatable).")
@click.option("--token-ids", "token_ids", multiple=True,
              help="A prompt as comma-separated token ids (repeatable).")
@click.option("--max-tokens", default=32, show_default=True, type=positive_int(),
              help="New tokens per prompt at most.")
@click.option("--temperature", default=0.0, show_default=True, type=FiniteFloat(min=0),
              help="Sampling temperature (0: greedy).")
@click.option("--top-p", default=1.0, show_default=True,
              type=FiniteFloat(min=0, max=1, min_open=True),
              help="Nucleus sampling: keep the smallest set of tokens of this probability.")
@click.option("--top-k", default=None, type=positive_int(0),
              help="Sample among the k most likely tokens (0 or unset: all).")
@click.option("--stream/--no-stream", default=False,
              help="Print the text as it is generated (one prompt at a time).")
@click.option("--chat", is_flag=True,
              help="Each --prompt is a user message, answered through the model's chat "
                   "template.")
@click.option("--system", default=None,
              help="A system message before each --chat prompt (implies --chat).")
@click.option("--stop", "stop", multiple=True, help="A stop string (repeatable).")
@engine_options(model="option")
def generate(prompts: tuple[str, ...], token_ids: tuple[str, ...], max_tokens: int,
             temperature: float, top_p: float, top_k: int | None, stream: bool, chat: bool,
             system: str | None, stop: tuple[str, ...], engine_args: EngineArgs) -> None:
    """Generate continuations of prompts (or chat answers) with a model."""
    from pagedcore.engine.chat import chat_prompt_ids
    from pagedcore.engine.errors import EngineStepError
    from pagedcore.engine.llm import LLM
    from pagedcore.engine.models.checkpoint import CheckpointError
    from pagedcore.engine.sampling.sampling_params import SamplingParams

    inputs: list[Any] = list(prompts)
    for text in token_ids:
        try:
            inputs.append([int(t) for t in text.split(",") if t.strip()])
        except ValueError as exc:
            raise click.BadParameter(f"{text!r} is not a comma-separated list of integers",
                                     param_hint="--token-ids") from exc
    if not inputs:
        raise click.UsageError("give at least one --prompt or --token-ids")
    chat = chat or system is not None
    if chat and token_ids:
        raise click.UsageError("--chat takes --prompt messages, not --token-ids")
    configure_cli_logging(engine_args)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                top_k=top_k, seed=engine_args.seed, stop=stop)
        try:
            llm = LLM.from_engine_args(engine_args)
        except CheckpointError as exc:  # found while loading (shapes, NaN): still the user's
            raise click.BadParameter(str(exc), param_hint="--model") from exc
        if prompts and llm.tokenizer is None:
            raise click.UsageError(f"--prompt needs a tokenizer: {llm.no_tokenizer_reason}; "
                                   "or give the prompt as --token-ids")
        if chat:
            inputs = [{"prompt_token_ids": chat_prompt_ids(
                llm.tokenizer, [*([{"role": "system", "content": system}] if system else []),
                                {"role": "user", "content": text}],
                model_name=llm.model_name)} for text in inputs]
        if stream:
            for one in inputs:  # one at a time, so the text of one prompt is contiguous
                _stream_one(llm, one, params)
            return
        outputs = llm.generate(inputs, params)
    except EngineStepError as exc:  # a step failed (a backend, the model): what it produced
        for out in exc.outputs:
            click.echo(f"[{out.request_id}] {_render(out)}" +
                       (f" error: {out.error}" if out.error else ""))
        raise click.ClickException(str(exc)) from exc
    except ValueError as exc:  # a user mistake (model, lengths, KV budget): exit status 2
        raise click.UsageError(str(exc)) from exc
    for out in outputs:
        click.echo(f"[{out.request_id}] {_render(out)}")


def _stream_one(llm: Any, prompt: Any, params: Any) -> None:
    """Print one prompt's text as its deltas arrive (token ids without a tokenizer)."""
    for out in llm.stream(prompt, params):
        completion = out.outputs[0]
        if llm.tokenizer is not None:
            click.echo(completion.text, nl=False)
        elif completion.token_ids:
            click.echo(" ".join(map(str, completion.token_ids)) + " ", nl=False)
        if out.finished:
            click.echo(f"\n[{out.request_id}] ({completion.finish_reason})")


def _render(out: Any) -> str:
    completion = out.outputs[0]
    body = completion.text if completion.text else " ".join(map(str, completion.token_ids))
    return f"{body!r} ({len(completion.token_ids)} tokens, {completion.finish_reason})"
