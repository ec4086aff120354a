"""`pagedcore bench engine`: pagedcore vs transformers' generate() and generate_batch().

Measures output tokens/s on one workload (prompts of random token ids, EOS ignored, greedy), the
host-side share (scheduling + input preparation) of step time with 256 running requests, and a
preemption stress check: many requests under a tight KV budget must finish with outputs identical
to an unconstrained run.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable
from typing import Any

import click

__all__ = ["engine"]


def _prompts(n: int, lo: int, hi: int, *, vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(10, vocab, (m,), generator=g).tolist() for m in lengths]


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: Any) -> tuple[Any, float]:
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - t0


def _llm(model: Any, *, device: Any, dtype: Any, backend: str | None, **kw: Any) -> Any:
    from pagedcore.engine.llm import LLM

    return LLM(model, device=device, dtype=dtype, backend=backend, **kw)


def run_pagedcore(llm: Any, prompts: list[list[int]], max_new: int) -> tuple[float, list[Any]]:
    """Output tokens/s of `llm.generate` (greedy, EOS ignored)."""
    from pagedcore.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    outs, secs = _timed(lambda: llm.generate(prompts, params), llm.device)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / secs, outs


def run_hf_static(model: Any, prompts: list[list[int]], max_new: int, *, batch_size: int,
                  device: Any) -> float:
    """Output tokens/s of transformers' generate() on left-padded static batches."""
    import torch

    def one_batch(batch: list[list[int]]) -> int:
        width = max(len(p) for p in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, p in enumerate(batch):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                 max_new_tokens=max_new, min_new_tokens=max_new,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        return int(out.shape[0] * (out.shape[1] - width))

    one_batch(prompts[:2])  # warm-up
    def run() -> int:
        return sum(one_batch(prompts[i:i + batch_size])
                   for i in range(0, len(prompts), batch_size))
    tokens, secs = _timed(run, device)
    return float(tokens / secs)


def run_hf_continuous(model: Any, prompts: list[list[int]], max_new: int,
                      device: Any) -> float | str:
    """Output tokens/s of transformers' generate_batch(), or why it could not run."""
    if not hasattr(model, "generate_batch"):
        return "generate_batch() not in this transformers version"
    from transformers import GenerationConfig

    config = GenerationConfig(  # type: ignore[no-untyped-call]
        max_new_tokens=max_new, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    try:
        model.generate_batch(inputs=prompts[:2], generation_config=config)
        outs, secs = _timed(lambda: model.generate_batch(inputs=prompts,
                                                         generation_config=config), device)
    except Exception as exc:  # report, do not abort the whole benchmark
        return f"generate_batch() failed: {type(exc).__name__}: {exc}"[:300]
    tokens = sum(len(getattr(o, "generated_tokens", []) or []) for o in outs.values())
    return float(tokens / secs)


def host_share(llm: Any, *, num_requests: int, vocab: int, decode_steps: int) -> dict[str, Any]:
    """Share of step time spent scheduling and preparing inputs, all requests decoding."""
    from pagedcore.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=decode_steps + 64, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(_prompts(num_requests, 32, 96, vocab=vocab, seed=11)):
        llm.add_request(f"host-{i}", p, params)
    while any(r.num_output_tokens == 0 for r in llm.scheduler.running) or llm.scheduler.waiting:
        llm.step()
    running = len(llm.scheduler.running)
    host0, step0 = llm.host_time, llm.step_time
    for _ in range(decode_steps):
        llm.step()
    host, step = llm.host_time - host0, llm.step_time - step0
    for i in range(num_requests):
        if f"host-{i}" in llm._parents:
            llm.abort(f"host-{i}")
    return {"running_requests": running, "host_ms_per_step": 1000 * host / decode_steps,
            "step_ms": 1000 * step / decode_steps, "host_share": host / step}


def preemption_stress(make: Callable[..., Any], *, num_requests: int, vocab: int,
                      tight_blocks: int) -> dict[str, Any]:
    """Outputs under a tight KV budget equal those of an unconstrained run."""
    import torch

    from pagedcore.engine.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(5)
    prompts = _prompts(num_requests, 8, 48, vocab=vocab, seed=7)
    lengths = torch.randint(8, 33, (num_requests,), generator=g).tolist()
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in lengths]
    free = make(kv_blocks=None)
    expected = [o.outputs[0].token_ids for o in free.generate(prompts, params)]
    tight = make(kv_blocks=tight_blocks)
    t0 = time.perf_counter()
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    secs = time.perf_counter() - t0
    kv = tight.kv_cache_manager
    kv.check_invariants()
    return {
        "requests": num_requests,
        "kv_blocks": tight.kv_cache_config.num_blocks,
        "preemptions": tight.stats()["preemptions"],
        "identical_outputs": got == expected,
        "mismatched_requests": sum(a != b for a, b in zip(got, expected, strict=True)),
        "blocks_leaked": kv.num_total_blocks - kv.num_free_blocks,
        "seconds": secs,
    }


@click.command()
@click.option("--small", is_flag=True, help="Tiny Qwen2 on CPU-friendly sizes (CI / laptops).")
@click.option("--device", default=None, help="cpu or cuda (default: cuda when available).")
@click.option("--backend", default=None, help="Force an attention backend.")
@click.option("--num-prompts", default=None, type=int, help="Prompts of the main workload.")
@click.option("--max-new", default=None, type=int, help="New tokens per prompt.")
@click.option("--big-num-prompts", default=None, type=int,
              help="Second, larger workload (pagedcore and generate_batch only); 0 skips.")
@click.option("--stress-requests", default=None, type=int, help="Preemption stress size.")
@click.option("--skip-hf", is_flag=True, help="Measure pagedcore only.")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False))
def engine(small: bool, device: str | None, backend: str | None, num_prompts: int | None,
           max_new: int | None, big_num_prompts: int | None, stress_requests: int | None,
           skip_hf: bool, json_path: str | None) -> None:
    """pagedcore vs transformers generate() / generate_batch(): tokens/s, host share, stress."""
    import torch
    from rich.console import Console
    from rich.table import Table

    from pagedcore.engine.models import qwen2_0_5b_config, random_model, tiny_config

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cpu":
        torch.set_num_threads(1)  # small models: one intra-op thread is fastest
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if small:
        config = tiny_config("qwen2", vocab_size=512, hidden_size=128, num_hidden_layers=2,
                             max_position_embeddings=2048)
        lo, hi = 16, 96
        num_prompts, max_new = num_prompts or 32, max_new or 32
        big = 0 if big_num_prompts is None else big_num_prompts
        stress_n = stress_requests or 100
    else:
        config = qwen2_0_5b_config()
        lo, hi = 64, 512
        num_prompts, max_new = num_prompts or 64, max_new or 128
        big = 1024 if big_num_prompts is None else big_num_prompts
        stress_n = stress_requests or 2000
    vocab = int(config.vocab_size)
    model = random_model(config, dtype=dtype, device=dev, seed=0)
    figures: dict[str, Any] = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "model": "tiny qwen2 (small)" if small else "Qwen2-0.5B-shaped, random weights",
        "prompt_len": [lo, hi],
        "max_new_tokens": max_new,
    }
    llm = _llm(copy.deepcopy(model), device=dev, dtype=dtype, backend=backend,
               max_model_len=hi + max_new + 64, max_num_seqs=256, max_num_batched_tokens=4096,
               kv_cache_memory_bytes=(8 << 30) if dev.type == "cuda" else (256 << 20))
    figures["backend"] = sorted(set(llm.backend_names))
    prompts = _prompts(num_prompts, lo, hi, vocab=vocab, seed=1)
    rows: list[tuple[str, str]] = []
    tps, _ = run_pagedcore(llm, prompts, max_new)
    figures["pagedcore_tok_s"] = tps
    rows.append((f"pagedcore, {num_prompts} prompts", f"{tps:,.0f} tok/s"))
    if not skip_hf:
        model.set_attn_implementation("sdpa")
        hf = run_hf_static(model, prompts, max_new, batch_size=num_prompts, device=dev)
        figures["hf_generate_tok_s"] = hf
        rows.append(("transformers generate() static batch", f"{hf:,.0f} tok/s"))
        cb = run_hf_continuous(model, prompts, max_new, dev)
        figures["hf_generate_batch_tok_s"] = cb
        rows.append(("transformers generate_batch()",
                     f"{cb:,.0f} tok/s" if isinstance(cb, float) else cb))
        for key in ("hf_generate_tok_s", "hf_generate_batch_tok_s"):
            if isinstance(figures[key], float):
                figures[f"speedup_vs_{key.removesuffix('_tok_s')}"] = tps / figures[key]
    if big:
        big_prompts = _prompts(big, lo, hi, vocab=vocab, seed=2)
        tps_big, _ = run_pagedcore(llm, big_prompts, max_new)
        figures["pagedcore_big_tok_s"] = tps_big
        rows.append((f"pagedcore, {big} prompts", f"{tps_big:,.0f} tok/s"))
        if not skip_hf:
            cb_big = run_hf_continuous(model, big_prompts, max_new, dev)
            figures["hf_generate_batch_big_tok_s"] = cb_big
            rows.append((f"generate_batch(), {big} prompts",
                         f"{cb_big:,.0f} tok/s" if isinstance(cb_big, float) else cb_big))
    share = host_share(llm, num_requests=256, vocab=vocab, decode_steps=8 if small else 16)
    figures["host_share_at_256"] = share
    rows.append((f"host share at {share['running_requests']} running",
                 f"{100 * share['host_share']:.1f}% ({share['host_ms_per_step']:.1f} of "
                 f"{share['step_ms']:.1f} ms)"))
    del llm

    if json_path:  # keep what was measured even if a later stage fails or runs out of time
        with open(json_path, "w") as fh:
            json.dump(figures, fh, indent=2)

    # head_dim 64 so that any forced GPU backend (which may not take tiny heads) can serve it.
    stress_cfg = tiny_config("qwen2", vocab_size=512, max_position_embeddings=256, head_dim=64)
    stress_model = random_model(stress_cfg, dtype=torch.float32, device=dev, seed=3)

    def make(kv_blocks: int | None) -> Any:
        from pagedcore.kv_cache.config import kv_cache_specs_from_hf_config

        specs = kv_cache_specs_from_hf_config(stress_cfg, block_size=16, dtype=torch.float32)
        page = next(iter(specs.values())).page_size_bytes * len(specs)
        blocks = kv_blocks if kv_blocks is not None else 4096
        return _llm(copy.deepcopy(stress_model), device=dev, dtype=torch.float32,
                    backend=backend, max_model_len=128, max_num_seqs=256,
                    max_num_batched_tokens=1024, kv_cache_memory_bytes=blocks * page)

    stress = preemption_stress(make, num_requests=stress_n, vocab=512, tight_blocks=24)
    figures["preemption_stress"] = stress
    rows.append((f"stress: {stress_n} requests, {stress['kv_blocks']} KV blocks",
                 f"{stress['preemptions']} preemptions, identical={stress['identical_outputs']}"))

    table = Table(title=f"pagedcore bench engine ({figures['device']}, {figures['dtype']})")
    table.add_column("measurement")
    table.add_column("result", justify="right")
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(figures, fh, indent=2)
