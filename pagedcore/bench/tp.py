"""`pagedcore bench tp`: throughput of `LLM(..., tensor_parallel_size=N)` for several N.

One workload (random token prompts, greedy, EOS ignored) per size; output tokens/s, the step
count, and how many outputs are token-identical to the first size's (in float32 all should be;
in bf16 the all-reduce's different summation order may flip near-ties).
"""

from __future__ import annotations

import gc
import json
import sys
import time
from typing import Any

import attrs
import click

from pagedcore.bench.report import git_commit
from pagedcore.cli_progress import progress_bar
from pagedcore.cli_types import IntList, OutputPath, positive_int
from pagedcore.engine.engine_args import EngineArgs
from pagedcore.engine.engine_args_cli import engine_options

__all__ = ["tp"]


def _prompts(n: int, lo: int, hi: int, *, vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(10, vocab, (m,), generator=g).tolist() for m in lengths]


def run_size(engine_args: EngineArgs, size: int, prompts: list[list[int]],
             max_new: int) -> tuple[dict[str, Any], list[list[int]]]:
    """Figures and output tokens of `engine_args` at tensor-parallel size `size`."""
    import torch

    from pagedcore.engine.llm import LLM
    from pagedcore.engine.sampling.sampling_params import SamplingParams

    llm = LLM.from_engine_args(attrs.evolve(engine_args, tensor_parallel_size=size))
    try:
        warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        llm.generate(prompts[:2], warm)
        params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
        if llm.device.type == "cuda":
            torch.cuda.synchronize(llm.device)
        steps0 = llm.num_steps
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        if llm.device.type == "cuda":
            torch.cuda.synchronize(llm.device)
        secs = time.perf_counter() - t0
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        figures = {
            "tensor_parallel_size": size,
            "seconds": secs,
            "output_tokens": sum(len(t) for t in tokens),
            "tokens_per_s": sum(len(t) for t in tokens) / secs,
            "steps": llm.num_steps - steps0,
            "num_blocks": llm.kv_cache_config.num_blocks,
            "backends": llm.backend_names,
            "cuda_graphs": llm.cudagraph_status(),
        }
    finally:
        shutdown = getattr(llm.runner, "shutdown", None)
        if shutdown is not None:
            shutdown()
        is_cuda = llm.device.type == "cuda"
        del llm
        gc.collect()
        if is_cuda:
            # The next size sizes its KV cache from the free memory: hand this one's back.
            torch.cuda.empty_cache()
    return figures, tokens


@click.command()
@click.option("--sizes", default="1,2", show_default=True, type=IntList(1),
              help="Comma list of N.")
@click.option("--num-prompts", default=64, show_default=True, type=positive_int(),
              help="Prompts of the workload.")
@click.option("--min-len", default=64, show_default=True, type=positive_int(),
              help="Shortest prompt (tokens).")
@click.option("--max-len", default=512, show_default=True, type=positive_int(),
              help="Longest prompt (tokens).")
@click.option("--max-new", default=128, show_default=True, type=positive_int(),
              help="New tokens per prompt.")
@click.option("--threads", default=None, type=int,
              help="torch intra-op threads per rank (default: 1 on CPU, unchanged on CUDA).")
@click.option("--json", "json_path", default=None, type=OutputPath(),
              help="Write the figures to this JSON file.")
@engine_options(model="option", exclude=("tensor_parallel_size", "log_stats", "log_interval"),
                defaults={"model": "random:qwen2-0.5b"})
def tp(sizes: list[int], num_prompts: int, min_len: int, max_len: int, max_new: int,
       threads: int | None, json_path: str | None, engine_args: EngineArgs) -> None:
    """Tokens/s of tensor_parallel_size N (e.g. 1 vs 2) on one workload (every rank loads
    --model; --kv-cache-memory is per rank; --enforce-eager compares like with like when
    N>1 runs eager)."""
    import torch

    from pagedcore.engine.distributed.executor import peek_config
    from pagedcore.engine.resources import resolve_device

    size_list = list(sizes)
    model = str(engine_args.model)
    if threads is None and resolve_device(engine_args.device).type == "cpu":
        threads = 1
    if threads is not None:
        torch.set_num_threads(threads)  # workers copy rank 0's setting
    vocab = int(peek_config(model).vocab_size)
    prompts = _prompts(num_prompts, min_len, max_len, vocab=vocab, seed=0)
    rows: list[dict[str, Any]] = []
    first: list[list[int]] | None = None
    advance = click.get_current_context().with_resource(
        progress_bar("bench tp", len(size_list)))
    for size in size_list:
        figures, tokens = run_size(engine_args, size, prompts, max_new)
        advance(1)
        if first is None:
            first = tokens
        figures["identical_to_first_size"] = sum(a == b for a, b in zip(first, tokens,
                                                                        strict=True))
        rows.append(figures)
    base = rows[0]["tokens_per_s"] if rows else 1.0
    click.echo(f"model {model}, {num_prompts} prompts of {min_len}-{max_len} tokens, "
               f"{max_new} new tokens, greedy")
    click.echo(f"{'N':>3} {'tok/s':>10} {'speedup':>8} {'steps':>6} {'blocks':>8} "
               f"{'identical':>10} {'graphs':>6}  backends")
    for r in rows:
        click.echo(f"{r['tensor_parallel_size']:>3} {r['tokens_per_s']:>10.1f} "
                   f"{r['tokens_per_s'] / base:>7.2f}x {r['steps']:>6} {r['num_blocks']:>8} "
                   f"{r['identical_to_first_size']:>4}/{num_prompts:<5} "
                   f"{'yes' if r['cuda_graphs']['enabled'] else 'no':>6}  "
                   f"{','.join(r['backends'])}")
    if json_path:
        with open(json_path, "w") as fh:
            json.dump({"command": "pagedcore bench tp " + " ".join(sys.argv[3:]),
                       "git_commit": git_commit(),
                       "engine_args": {k: v for k, v in attrs.asdict(
                           engine_args, recurse=False).items() if k != "tokenizer"},
                       "model": model, "num_prompts": num_prompts, "min_len": min_len,
                       "max_len": max_len, "max_new": max_new, "rows": rows}, fh, indent=2,
                      default=str)
