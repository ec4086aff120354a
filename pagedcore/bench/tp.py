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

import click

from pagedcore.bench.report import git_commit
from pagedcore.cli_types import BACKEND, DEVICE, IntList, OutputPath, positive_int

__all__ = ["tp"]


def _prompts(n: int, lo: int, hi: int, *, vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(10, vocab, (m,), generator=g).tolist() for m in lengths]


def run_size(model: str, size: int, prompts: list[list[int]], max_new: int, *,
             device: str | None, dtype: str | None, backend: str | None,
             kv_cache_memory_bytes: int | None,
             enforce_eager: bool = False) -> tuple[dict[str, Any], list[list[int]]]:
    """Figures and output tokens of one tensor-parallel size."""
    import torch

    from pagedcore.engine.llm import LLM
    from pagedcore.engine.sampling.sampling_params import SamplingParams

    llm = LLM(model, device=device, dtype=dtype, backend=backend, tensor_parallel_size=size,
              kv_cache_memory_bytes=kv_cache_memory_bytes, enforce_eager=enforce_eager)
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
@click.option("--model", default="random:qwen2-0.5b", show_default=True,
              help="Checkpoint directory, 'demo' or 'random:<type>' (every rank loads it).")
@click.option("--sizes", default="1,2", show_default=True, type=IntList(1),
              help="Comma list of N.")
@click.option("--device", default=None, type=DEVICE,
              help="cpu or cuda (default: cuda when available).")
@click.option("--dtype", default=None, help="float32, bfloat16, ... (default: bf16 on CUDA).")
@click.option("--backend", default=None, type=BACKEND, help="Force an attention backend.")
@click.option("--num-prompts", default=64, show_default=True, type=positive_int())
@click.option("--min-len", default=64, show_default=True, type=positive_int())
@click.option("--max-len", default=512, show_default=True, type=positive_int())
@click.option("--max-new", default=128, show_default=True, type=positive_int())
@click.option("--kv-cache-memory-bytes", default=None, type=int,
              help="Per-rank KV budget (default: as LLM).")
@click.option("--threads", default=None, type=int,
              help="torch intra-op threads per rank (default: 1 on CPU, unchanged on CUDA).")
@click.option("--enforce-eager", is_flag=True,
              help="No CUDA graphs at any size (compare like with like when N>1 runs eager).")
@click.option("--json", "json_path", default=None, type=OutputPath())
def tp(model: str, sizes: list[int], device: str | None, dtype: str | None, backend: str | None,
       num_prompts: int, min_len: int, max_len: int, max_new: int,
       kv_cache_memory_bytes: int | None, threads: int | None, enforce_eager: bool,
       json_path: str | None) -> None:
    """Tokens/s of tensor_parallel_size N (e.g. 1 vs 2) on one workload."""
    import torch

    from pagedcore.engine.distributed.executor import peek_config
    from pagedcore.engine.resources import resolve_device

    size_list = list(sizes)
    if threads is None and resolve_device(device).type == "cpu":
        threads = 1
    if threads is not None:
        torch.set_num_threads(threads)  # workers copy rank 0's setting
    vocab = int(peek_config(model).vocab_size)
    prompts = _prompts(num_prompts, min_len, max_len, vocab=vocab, seed=0)
    rows: list[dict[str, Any]] = []
    first: list[list[int]] | None = None
    for size in size_list:
        figures, tokens = run_size(model, size, prompts, max_new, device=device, dtype=dtype,
                                   backend=backend, kv_cache_memory_bytes=kv_cache_memory_bytes,
                                   enforce_eager=enforce_eager)
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
                       "model": model, "num_prompts": num_prompts, "min_len": min_len,
                       "max_len": max_len, "max_new": max_new, "rows": rows}, fh, indent=2)
