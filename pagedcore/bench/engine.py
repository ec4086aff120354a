"""`pagedcore bench engine`: pagedcore vs transformers' generate() and generate_batch().

Measures output tokens/s on one workload (prompts of random token ids, EOS ignored, greedy) for
pagedcore with CUDA graphs for decode steps and without (eager), and for transformers; CUDA
graphs vs eager parity; prompt tokens/s of a prefill-heavy workload (`PREFILL_WORKLOAD`: long
prompts, one new token each, on an eager engine), where the backend's prefill kernel weighs
most; the host-side share (scheduling + input preparation) of step time with
256 running requests; a larger workload; and a preemption stress check: many requests under a
tight KV budget must finish with outputs identical to an unconstrained run. With ``--json`` the
file is rewritten after every stage, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import click

from pagedcore.bench.engine_runs import (
    graph_parity,
    host_share,
    preemption_stress,
    prompts,
    run_hf_continuous,
    run_hf_static,
    run_pagedcore,
    run_prefill,
)
from pagedcore.cli_progress import progress_bar
from pagedcore.cli_types import OutputPath, positive_int
from pagedcore.engine.engine_args_cli import engine_options

__all__ = ["PREFILL_WORKLOAD", "STAGES", "engine"]

#: The stages of `pagedcore bench engine`, in the order they run (``--only`` picks some).
STAGES = ("parity", "throughput", "prefill", "host_share", "hf", "big", "stress")

#: The prefill-heavy stage: prompts x tokens each, one new token (``--small``: tiny).
PREFILL_WORKLOAD = (4, 8192)
PREFILL_WORKLOAD_SMALL = (2, 128)


def _llm(model: Any, *, device: Any, dtype: Any, backend: str | None, **kw: Any) -> Any:
    from pagedcore.engine.llm import LLM

    return LLM(model, device=device, dtype=dtype, backend=backend, **kw)


class _Report:
    """The figures so far, the table rows, and the JSON file rewritten after each stage."""

    def __init__(self, path: str | None, figures: dict[str, Any]) -> None:
        self.path = path
        self.figures = figures
        self.rows: list[tuple[str, str]] = []
        # A figure measured moves the bar (how many a run takes depends on its stages).
        self.advance = click.get_current_context().with_resource(
            progress_bar("bench engine", None))

    def add(self, key: str, value: Any, row: tuple[str, str] | None = None) -> None:
        self.advance(1)
        self.figures[key] = value
        if row is not None:
            self.rows.append(row)
            click.echo(f"  {row[0]}: {row[1]}", err=True)
        self.save()

    def save(self) -> None:
        if self.path:
            with open(self.path, "w") as fh:
                json.dump(self.figures, fh, indent=2, default=str)
                fh.write("\n")


def _tok_s(value: Any) -> str:
    return f"{value:,.0f} tok/s" if isinstance(value, float) else str(value)


@click.command()
@click.option("--small", is_flag=True, help="Tiny Qwen2 on CPU-friendly sizes (CI / laptops).")
@click.option("--model", "model_name", default="qwen2-0.5b", show_default=True,
              type=click.Choice(["qwen2-0.5b", "llama3-8b"]),
              help="Model shape (seeded random weights); with --small its tiny version.")
@click.option("--num-prompts", default=None, type=positive_int(),
              help="Prompts of the main workload.")
@click.option("--max-new", default=None, type=positive_int(), help="New tokens per prompt.")
@click.option("--big-num-prompts", default=None, type=positive_int(0),
              help="Second, larger workload (pagedcore, and generate_batch unless capped to 0).")
@click.option("--hf-big-num-prompts", default=None, type=positive_int(0),
              help="Cap generate_batch() on the larger workload to this many prompts (it takes "
                   "minutes on 1,024); 0 skips it. Default: no cap.")
@click.option("--stress-requests", default=None, type=positive_int(0),
              help="Preemption stress size; 0 skips the stage.")
@click.option("--parity-prompts", default=None, type=positive_int(0),
              help="Prompts of the CUDA graphs vs eager parity check; 0 skips it.")
@click.option("--skip-hf", is_flag=True, help="Measure pagedcore only.")
@click.option("--skip-eager", is_flag=True,
              help="Do not measure pagedcore without CUDA graphs (eager) for comparison.")
@click.option("--only", default=None,
              help="Run only these stages (comma-separated): " + ", ".join(STAGES) + ".")
@click.option("--parity-new", default=None, type=positive_int(),
              help="New tokens per prompt of the parity check (default: min(max-new, 32)).")
@click.option("--host-profile", default=None, type=click.Path(dir_okay=False),
              help="Write a cProfile (top 30) of 16 more steps at 256 running (graphs) here.")
@click.option("--json", "json_path", default=None, type=OutputPath(),
              help="Write the figures to this JSON file.")
@engine_options(model=None, overrides=True)
def engine(small: bool, model_name: str, num_prompts: int | None,
           max_new: int | None, big_num_prompts: int | None, hf_big_num_prompts: int | None,
           stress_requests: int | None, parity_prompts: int | None, skip_hf: bool,
           skip_eager: bool, only: str | None, parity_new: int | None,
           host_profile: str | None, json_path: str | None,
           engine_overrides: dict[str, Any]) -> None:
    """pagedcore (CUDA graphs / eager) vs transformers generate() / generate_batch(): tokens/s,
    graph parity, a prefill-heavy workload, host share at 256 running, a larger workload,
    preemption stress.

    The engine options given apply to the measured engines (not to the preemption stress
    stage's tiny float32 model and tight KV budget, except --device and --backend)."""
    stages = _stages(only)
    overrides = dict(engine_overrides)
    enforce_eager = bool(overrides.pop("enforce_eager", False))
    _run_engine_bench(
        small=small, model_name=model_name, device=overrides.get("device"),
        backend=overrides.get("backend"), overrides=overrides, num_prompts=num_prompts,
        max_new=max_new, big_num_prompts=big_num_prompts,
        hf_big_num_prompts=hf_big_num_prompts, stress_requests=stress_requests,
        parity_prompts=parity_prompts, skip_hf=skip_hf or "hf" not in stages,
        skip_eager=skip_eager, enforce_eager=enforce_eager, stages=stages,
        parity_new=parity_new, host_profile=host_profile, json_path=json_path,
    )


def _stages(only: str | None) -> frozenset[str]:
    if only is None:
        return frozenset(STAGES)
    chosen = frozenset(x.strip() for x in only.split(",") if x.strip())
    unknown = sorted(chosen - set(STAGES))
    if unknown or not chosen:
        raise click.BadParameter(
            f"unknown stage(s) {unknown or only!r}; choose from {', '.join(STAGES)}",
            param_hint="--only",
        )
    return chosen


def _run_engine_bench(
    *, small: bool, device: str | None, backend: str | None, num_prompts: int | None,
    max_new: int | None, big_num_prompts: int | None, hf_big_num_prompts: int | None,
    model_name: str = "qwen2-0.5b",
    stress_requests: int | None, parity_prompts: int | None, skip_hf: bool,
    skip_eager: bool, enforce_eager: bool, stages: frozenset[str], parity_new: int | None,
    host_profile: str | None, json_path: str | None, overrides: dict[str, Any] | None = None,
) -> None:
    import torch
    from rich.console import Console
    from rich.table import Table

    from pagedcore.bench.report import engine_bench_model, environment, with_overrides

    overrides = overrides or {}
    dev, dtype, config = engine_bench_model(small, device, model_name,
                                            dtype=overrides.get("dtype"))
    if small:
        lo, hi = 16, 96
        # None (not given) takes the default; 0 is refused by the option types.
        num_prompts = 32 if num_prompts is None else num_prompts
        max_new = 32 if max_new is None else max_new
        big = 0 if big_num_prompts is None else big_num_prompts
        stress_n = 100 if stress_requests is None else stress_requests
        parity_n = 8 if parity_prompts is None else parity_prompts
    else:
        lo, hi = 64, 512
        num_prompts = 64 if num_prompts is None else num_prompts
        max_new = 128 if max_new is None else max_new
        big = 1024 if big_num_prompts is None else big_num_prompts
        stress_n = 2000 if stress_requests is None else stress_requests
        parity_n = 32 if parity_prompts is None else parity_prompts
    big = big if "big" in stages else 0
    stress_n = stress_n if "stress" in stages else 0
    parity_n = parity_n if "parity" in stages else 0
    vocab = int(config.vocab_size)
    report = _Report(json_path, {
        "environment": environment(dev),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "model": f"tiny {model_name} (small)" if small
        else f"{model_name}-shaped, random weights",
        "prompt_len": [lo, hi],
        "max_new_tokens": max_new,
    })
    from pagedcore.engine.models.loading import random_model

    model = random_model(config, dtype=dtype, device=dev, seed=0)
    engine_kw: dict[str, Any] = dict(
        device=dev, dtype=dtype, backend=backend, max_model_len=hi + max_new + 64,
        max_num_seqs=256, max_num_batched_tokens=4096,
        kv_cache_memory_bytes=(8 << 30) if dev.type == "cuda" else (256 << 20),
    )
    engine_kw = with_overrides(engine_kw, overrides)
    report.add("engine_config", {k: v for k, v in engine_kw.items()
                                 if k not in ("device", "dtype")})
    llm = _llm(copy.deepcopy(model), enforce_eager=enforce_eager, **engine_kw)
    report.add("backend", sorted(set(llm.backend_names)))
    status = llm.cudagraph_status()
    report.add("cudagraph", status, ("CUDA graphs", "on, captured in "
                                     f"{status['capture_seconds']:.1f} s" if status["enabled"]
                                     else f"off: {status['reason']}"))
    eager = None
    if status["enabled"] and not skip_eager and stages & {"parity", "throughput", "host_share"}:
        eager = _llm(copy.deepcopy(model), enforce_eager=True, **engine_kw)
    main_prompts = prompts(num_prompts, lo, hi, vocab=vocab, seed=1)
    warmup = prompts(16, lo, hi, vocab=vocab, seed=99)

    if eager is not None and parity_n:
        parity = graph_parity(llm, eager, prompts(parity_n, lo, hi, vocab=vocab, seed=3),
                              max_new=parity_new or min(max_new, 32))
        report.add("graph_parity", parity, (
            f"graphs vs eager, {parity_n} prompts",
            f"{parity['identical_requests']}/{parity_n} identical, max |dlogprob| "
            f"{parity['max_abs_logprob_diff_while_agreeing']:.3g}"))

    label = "pagedcore (CUDA graphs)" if status["enabled"] else "pagedcore (eager)"
    run: dict[str, Any] | None = None
    if "throughput" in stages or "hf" in stages:
        run = run_pagedcore(llm, main_prompts, max_new, warmup=warmup)
        report.add("pagedcore", run, (f"{label}, {num_prompts} prompts", _tok_s(run["tok_s"])))
        report.add("pagedcore_tok_s", run["tok_s"])
    if eager is not None and "throughput" in stages and run is not None:
        run_e = run_pagedcore(eager, main_prompts, max_new, warmup=warmup)
        report.add("pagedcore_eager", run_e,
                   (f"pagedcore (eager), {num_prompts} prompts", _tok_s(run_e["tok_s"])))
        report.add("graph_speedup", run["tok_s"] / run_e["tok_s"])

    if "prefill" in stages:
        _prefill_stage(report, model, engine_kw, small=small, vocab=vocab)

    if "host_share" in stages:
        share = host_share(llm, num_requests=256, vocab=vocab,
                           decode_steps=8 if small else 16, profile_path=host_profile)
        report.add("host_share_at_256", share, (
            f"host share at {share['running_requests']} running ({label})",
            f"{100 * share['host_share']:.1f}% ({share['host_ms_per_step']:.2f} of "
            f"{share['step_ms']:.2f} ms)"))
    if eager is not None and "host_share" in stages:
        share_e = host_share(eager, num_requests=256, vocab=vocab,
                             decode_steps=8 if small else 16)
        report.add("host_share_at_256_eager", share_e, (
            "host share at 256 running (eager)",
            f"{100 * share_e['host_share']:.1f}% ({share_e['host_ms_per_step']:.2f} of "
            f"{share_e['step_ms']:.2f} ms)"))
    del eager

    if not skip_hf and run is not None:
        model.set_attn_implementation("sdpa")
        hf = run_hf_static(model, main_prompts, max_new, batch_size=num_prompts, device=dev)
        report.add("hf_generate_tok_s", hf, ("transformers generate() static batch", _tok_s(hf)))
        cb = run_hf_continuous(model, main_prompts, max_new, dev)
        report.add("hf_generate_batch_tok_s", cb, ("transformers generate_batch()", _tok_s(cb)))
        for key in ("hf_generate_tok_s", "hf_generate_batch_tok_s"):
            if isinstance(report.figures[key], float):
                report.add(f"speedup_vs_{key.removesuffix('_tok_s')}",
                           run["tok_s"] / report.figures[key])
    if big:
        big_prompts = prompts(big, lo, hi, vocab=vocab, seed=2)
        run_big = run_pagedcore(llm, big_prompts, max_new, warmup=warmup)
        report.add("pagedcore_big", run_big, (f"{label}, {big} prompts",
                                              _tok_s(run_big["tok_s"])))
        report.add("pagedcore_big_tok_s", run_big["tok_s"])
        hf_n = big if hf_big_num_prompts is None else min(big, hf_big_num_prompts)
        if skip_hf or hf_n == 0:
            report.add("hf_generate_batch_big", "skipped (--skip-hf or --hf-big-num-prompts 0)")
        else:
            cb_big = run_hf_continuous(model, big_prompts[:hf_n], max_new, dev)
            report.add("hf_generate_batch_big", {"prompts": hf_n, "capped": hf_n < big,
                                                 "tok_s": cb_big},
                       (f"generate_batch(), {hf_n} of {big} prompts", _tok_s(cb_big)))
    del llm

    if stress_n:
        stress = _stress(dev, backend, stress_n)
        report.add("preemption_stress", stress, (
            f"stress: {stress_n} requests, {stress['kv_blocks']} KV blocks",
            f"{stress['preemptions']} preemptions, identical={stress['identical_outputs']}"))

    table = Table(title=f"pagedcore bench engine ({report.figures['device']}, "
                        f"{report.figures['dtype']})")
    table.add_column("measurement")
    table.add_column("result", justify="right")
    for name, value in report.rows:
        table.add_row(name, value)
    Console().print(table)


def _prefill_stage(report: _Report, model: Any, engine_kw: dict[str, Any], *, small: bool,
                   vocab: int) -> None:
    """The prefill-heavy workload (`PREFILL_WORKLOAD`) on an eager engine of its own whose
    ``max_model_len`` fits it: every step is a prefill chunk (``max_num_batched_tokens``
    tokens, the later chunks over a cached prefix), where the attention backend's prefill
    kernel weighs most; eager for every backend alike (no graph covers such steps)."""
    n, length = PREFILL_WORKLOAD_SMALL if small else PREFILL_WORKLOAD
    llm = _llm(copy.deepcopy(model), enforce_eager=True,
               **{**engine_kw, "max_model_len": length + 64})
    run = run_prefill(llm, prompts(n, length, length, vocab=vocab, seed=5),
                      warmup=prompts(n, length, length, vocab=vocab, seed=6))
    report.add("prefill_heavy", run, (
        f"prefill-heavy (eager), {n} prompts x {length} tokens, 1 new",
        f"{run['prompt_tok_s']:,.0f} prompt tok/s ({1e3 * run['seconds']:.0f} ms, "
        f"{run['steps']} steps)"))
    del llm


def _stress(dev: Any, backend: str | None, num_requests: int) -> dict[str, Any]:
    """Preemption stress on a tiny float32 model (head_dim 64 so any forced GPU backend can
    serve it)."""
    import torch

    from pagedcore.engine.models.loading import random_model, tiny_config
    from pagedcore.kv_cache.config import kv_cache_specs_from_hf_config

    stress_cfg = tiny_config("qwen2", vocab_size=512, max_position_embeddings=256, head_dim=64)
    stress_model = random_model(stress_cfg, dtype=torch.float32, device=dev, seed=3)

    def make(kv_blocks: int | None) -> Any:
        specs = kv_cache_specs_from_hf_config(stress_cfg, block_size=16, dtype=torch.float32)
        page = next(iter(specs.values())).page_size_bytes * len(specs)
        blocks = kv_blocks if kv_blocks is not None else 4096
        return _llm(copy.deepcopy(stress_model), device=dev, dtype=torch.float32,
                    backend=backend, max_model_len=128, max_num_seqs=256,
                    max_num_batched_tokens=1024, kv_cache_memory_bytes=blocks * page)

    return preemption_stress(make, num_requests=num_requests, vocab=512, tight_blocks=24)
