"""`pagedcore bench memory`: KV slots holding live tokens, paged vs contiguous preallocation.

At one KV budget (bytes), a workload of requests with seeded log-normal prompt and output lengths
is admitted in order until the cache is full, counting each request at its final length:

- contiguous preallocation (the pre-paging serving systems): every request reserves
  ``max_model_len`` slots up front, so concurrency is ``budget_slots // max_model_len`` and the
  rest of each reservation is internal fragmentation;
- paged: the real `pagedcore.kv_cache.KVCacheManager` hands out blocks until
  ``allocate_slots`` refuses; waste is only the unfilled tail of each request's last block.

A block-size sweep repeats the paged count at the same budget for several block sizes (tail
waste grows with the block) next to the decode-kernel speed at that block size: from
``--kernel-json`` rows carrying a ``block_size`` when given, else measured here with
`pagedcore.bench.kernel_primitives` (a decode step of every backend that accepts the block
size).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import click

from pagedcore.bench.kernel_primitives import HeadShape
from pagedcore.cli_progress import progress_bar
from pagedcore.cli_types import DEVICE, OutputPath, positive_int

__all__ = ["contiguous_admission", "memory", "paged_admission", "workload_lengths"]


class _SeqRequest:
    """The least a request must carry for the KV-cache manager (no prefix caching here)."""

    def __init__(self, request_id: str, length: int) -> None:
        self.request_id = request_id
        self.num_computed_tokens = 0
        self.cache_salt: str | None = None
        self.lora_name: str | None = None
        self._tokens = list(range(length))

    @property
    def all_token_ids(self) -> Sequence[int]:
        return self._tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self._tokens)


def workload_lengths(n: int, *, max_model_len: int, seed: int = 0) -> list[int]:
    """Prompt + output lengths: log-normal prompts (median 512) and outputs (median 256),
    clipped to ``[16, max_model_len]``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    prompt = torch.exp(torch.randn(n, generator=g) * 1.0 + torch.log(torch.tensor(512.0)))
    output = torch.exp(torch.randn(n, generator=g) * 0.8 + torch.log(torch.tensor(256.0)))
    total = (prompt + output).round().clamp(16, max_model_len).to(torch.int64)
    return [int(x) for x in total.tolist()]


def _kv_config(config: Any, *, block_size: int, dtype: Any, budget_bytes: int,
               max_model_len: int) -> Any:
    from pagedcore.kv_cache.config import kv_cache_specs_from_hf_config, make_kv_cache_config

    specs = kv_cache_specs_from_hf_config(config, block_size=block_size, dtype=dtype)
    return make_kv_cache_config(specs, memory_bytes=budget_bytes, max_model_len=max_model_len,
                                max_num_batched_tokens=max_model_len)


def paged_admission(kv_config: Any, lengths: Sequence[int], *,
                    max_model_len: int) -> dict[str, Any]:
    """Admit requests (at their final lengths) into a real `KVCacheManager` until it is full."""
    from pagedcore.kv_cache.manager import KVCacheManager

    manager = KVCacheManager(kv_config, max_model_len, enable_caching=False)
    block = kv_config.groups[0].spec.block_size
    admitted: list[int] = []
    for i, n in enumerate(lengths):
        if manager.allocate_slots(_SeqRequest(f"r{i}", n), n) is None:
            break
        admitted.append(n)
    if len(admitted) == len(lengths):
        raise ValueError(f"the workload of {len(lengths)} requests never filled the cache; "
                         "pass more requests or a smaller budget")
    manager.check_invariants()
    usable = kv_config.num_blocks - 1  # block 0 is the null block
    used = usable - manager.num_free_blocks
    return {
        "block_size": block,
        "num_blocks": kv_config.num_blocks,
        "budget_slots": kv_config.num_blocks * block,
        "max_concurrency": len(admitted),
        "live_tokens": sum(admitted),
        "allocated_slots": used * block,
        "live_fraction_of_allocated": sum(admitted) / (used * block),
        "live_fraction_of_budget": sum(admitted) / (kv_config.num_blocks * block),
        "tail_waste_fraction": 1 - sum(admitted) / (used * block),
    }


def contiguous_admission(budget_slots: int, lengths: Sequence[int], *,
                         max_model_len: int) -> dict[str, Any]:
    """Every request reserves `max_model_len` slots up front (contiguous preallocation)."""
    capacity = budget_slots // max_model_len
    admitted = list(lengths[:capacity])
    reserved = capacity * max_model_len
    return {
        "budget_slots": budget_slots,
        "max_concurrency": capacity,
        "live_tokens": sum(admitted),
        "allocated_slots": reserved,
        "live_fraction_of_allocated": sum(admitted) / reserved if reserved else None,
        "live_fraction_of_budget": sum(admitted) / budget_slots,
    }


def model_heads(config: Any) -> HeadShape:
    """A transformers config's attention heads: query heads, KV heads (the query heads when
    the config names none) and head size (``head_dim``, else hidden size / query heads)."""
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    size = int(getattr(config, "head_dim", None) or int(config.hidden_size) // heads)
    return HeadShape(heads, kv, size)


def measure_kernel_speed(block_sizes: Sequence[int], *, batch: int, ctx: int,
                         device: Any, heads: HeadShape | None = None) -> list[dict[str, Any]]:
    """Decode time and KV read bandwidth per (backend, block size), via `kernel_primitives`,
    at `heads` (query / KV heads and head size; default `kernel_primitives.DEFAULT_HEADS`,
    32 / 8 of 128)."""
    import torch

    from pagedcore.attention import AttentionConfig
    from pagedcore.bench import kernel_primitives as k
    from pagedcore.plugins.registry import get_registry

    heads = heads or k.DEFAULT_HEADS
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows: list[dict[str, Any]] = []
    for block in block_sizes:
        cfg = AttentionConfig(head_size=heads.head_size, block_size=block, device=device.type,
                              dtype="bfloat16" if device.type == "cuda" else "float32")
        registry = get_registry()
        backends = [registry.get(n) for n in registry.backends
                    if not registry.get(n).validate_configuration(cfg)]
        if not backends:
            continue
        torch.manual_seed(0)
        kv = k.PagedKV([ctx] * batch, dtype, device, block_size=block,
                       num_kv_heads=heads.num_kv_heads, head_size=heads.head_size)
        query = torch.randn((batch, heads.num_heads, heads.head_size), dtype=dtype,
                            device=device)
        kv_bytes = 2 * batch * ctx * heads.num_kv_heads * heads.head_size * dtype.itemsize
        for backend in backends:
            try:
                under = k.BackendUnderTest(backend, kv, num_heads=heads.num_heads)
                ms = k.time_ms(under.runner(kv, [1] * batch, list(range(batch)), query),
                               device, budget_ms=200.0)
            except Exception as exc:  # one backend failing must not sink the sweep
                rows.append({"backend": backend.name, "block_size": block,
                             "error": f"{type(exc).__name__}: {exc}"[:300]})
                continue
            rows.append({"backend": backend.name, "block_size": block, "ms": ms,
                         "kv_GBps": kv_bytes / ms / 1e6, "shape": f"{batch}x{ctx}"})
        del kv
    return rows


def _plot(report: dict[str, Any], path: str) -> None:
    from pagedcore.bench.report import save_figure, subplots

    fig, (a1, a2, a3) = subplots(3, width=4.8)
    paged, contig = report["paged"], report["contiguous"]
    names = ["contiguous\n(reserve max_model_len)", f"paged\n(block {paged['block_size']})"]
    a1.bar(names, [contig["max_concurrency"], paged["max_concurrency"]],
           color=["tab:gray", "tab:blue"])
    a1.set_ylabel("requests resident at once")
    a1.set_title("max concurrency, same KV budget")
    for i, v in enumerate([contig["max_concurrency"], paged["max_concurrency"]]):
        a1.annotate(str(v), (i, v), ha="center", va="bottom")
    fr = [contig["live_fraction_of_allocated"] * 100, paged["live_fraction_of_allocated"] * 100]
    a2.bar(names, fr, color=["tab:gray", "tab:blue"])
    for i, v in enumerate(fr):
        a2.annotate(f"{v:.1f}%", (i, v), ha="center", va="bottom")
    a2.set_ylim(0, 105)
    a2.set_ylabel("% of reserved KV slots holding live tokens")
    a2.set_title("slot utilization")
    sweep = report["block_size_sweep"]
    blocks = [r["block_size"] for r in sweep]
    a3.plot(blocks, [100 * r["tail_waste_fraction"] for r in sweep], "o-", color="tab:red",
            label="tail waste %")
    a3.set_xscale("log", base=2)
    a3.set_xticks(blocks, [str(b) for b in blocks])
    a3.set_xlabel("block size (tokens)")
    a3.set_ylabel("tail waste %", color="tab:red")
    a3.set_title("block-size sweep")
    speed = [r for r in report["kernel_speed"]["rows"] if "kv_GBps" in r]
    if speed:
        twin = a3.twinx()
        for name in sorted({r["backend"] for r in speed}):
            pts = sorted((r["block_size"], r["kv_GBps"]) for r in speed if r["backend"] == name)
            twin.plot([p[0] for p in pts], [p[1] for p in pts], "s--", label=f"{name} decode")
        twin.set_ylabel(f"decode KV read GB/s ({speed[0].get('shape', '')})")
        twin.legend(fontsize=7, loc="center right")
    a3.legend(fontsize=7, loc="upper left")
    env = report["environment"]
    save_figure(fig, path, caption=f"{env['device']} · budget "
                f"{report['budget_bytes'] / 2**20:.0f} MiB · max_model_len "
                f"{report['max_model_len']} · commit {env['git_commit']}")


@click.command()
@click.option("--small", is_flag=True, help="CPU kernel timing at a small decode shape.")
@click.option("--device", default=None, type=DEVICE, help="Device of the kernel timing.")
@click.option("--model", "model_name", default="qwen2-0.5b", show_default=True,
              type=click.Choice(["qwen2-0.5b", "llama3-8b"]),
              help="Model shape whose KV cache is counted (bytes per token).")
@click.option("--budget-mib", default=1024, show_default=True, type=positive_int(),
              help="KV budget in MiB.")
@click.option("--max-model-len", default=4096, show_default=True, type=positive_int(),
              help="Tokens per request the budget must hold.")
@click.option("--kernel-json", default=None, type=click.Path(exists=True, dir_okay=False),
              help="Kernel speed per block size from this JSON (rows with block_size).")
@click.option("--json", "json_path", default=None, type=OutputPath(),
              help="Write the figures to this JSON file.")
@click.option("--plot", "plot_path", default=None, type=OutputPath(),
              help="Write the plot to this image file (png, svg, ...).")
def memory(small: bool, device: str | None, model_name: str, budget_mib: int, max_model_len: int,
           kernel_json: str | None, json_path: str | None, plot_path: str | None) -> None:
    """Paged vs contiguous KV preallocation (slot use, concurrency) and a block-size sweep."""
    import json

    import torch

    from pagedcore.bench.report import (
        bench_model_config,
        environment,
        model_shape,
        pick_device,
        write_json,
    )

    dev = pick_device(device)
    config = bench_model_config(model_name)
    dtype = torch.bfloat16
    budget = budget_mib << 20
    lengths = workload_lengths(20000, max_model_len=max_model_len, seed=0)
    base = _kv_config(config, block_size=16, dtype=dtype, budget_bytes=budget,
                      max_model_len=max_model_len)
    paged = paged_admission(base, lengths, max_model_len=max_model_len)
    # The same budget with an fp8 (e4m3) KV cache: a block takes half the bytes.
    fp8_cfg = _kv_config(config, block_size=16, dtype=torch.float8_e4m3fn, budget_bytes=budget,
                         max_model_len=max_model_len)
    paged_fp8 = paged_admission(fp8_cfg, lengths, max_model_len=max_model_len)
    contig = contiguous_admission(base.num_blocks * 16, lengths, max_model_len=max_model_len)
    blocks = [8, 16, 32, 64, 128, 256]
    sweep = []
    advance = click.get_current_context().with_resource(progress_bar("bench memory",
                                                                     len(blocks)))
    for b in blocks:
        advance(1)
        cfg = _kv_config(config, block_size=b, dtype=dtype, budget_bytes=budget,
                         max_model_len=max_model_len)
        sweep.append(paged_admission(cfg, lengths, max_model_len=max_model_len))
    if kernel_json:
        with open(kernel_json) as fh:
            data = json.load(fh)
        rows = [r for r in data.get("results", data.get("rows", [])) if "block_size" in r]
        speed = {"source": kernel_json, "rows": rows}
    else:
        batch, ctx = (8, 1024) if small or dev.type == "cpu" else (64, 4096)
        heads = model_heads(config)
        speed = {"source": f"measured now with pagedcore.bench.kernels (decode {batch}x{ctx}, "
                           f"{heads.num_heads} q / {heads.num_kv_heads} KV heads, head "
                           f"{heads.head_size}: the model's)",
                 "rows": measure_kernel_speed(blocks, batch=batch, ctx=ctx, device=dev,
                                              heads=heads)}
    report: dict[str, Any] = {
        "experiment": "memory: paged vs contiguous KV preallocation",
        "environment": environment(dev),
        "model": model_shape(config, dtype=dtype, kv_dtype=dtype, name=model_name),
        "budget_bytes": budget,
        "max_model_len": max_model_len,
        "workload": "20,000 requests, prompt ~ lognormal(median 512, sigma 1.0) + output ~ "
                    "lognormal(median 256, sigma 0.8), clipped to [16, max_model_len], seed 0; "
                    "admitted in order at their final length until the cache is full",
        "workload_mean_tokens": sum(lengths) / len(lengths),
        "engine_config": {"block_size": 16, "enable_prefix_caching": False},
        "warmup": "kernel timing: bench.kernels.time_ms (2 warm-up calls, median of samples)",
        "repetitions": "bookkeeping is deterministic; kernel timing median of up to 30 samples",
        "paged": paged,
        "contiguous": contig,
        "concurrency_gain": paged["max_concurrency"] / max(1, contig["max_concurrency"]),
        "paged_fp8_kv": paged_fp8,
        "fp8_kv_concurrency_gain": paged_fp8["max_concurrency"] / max(1, paged["max_concurrency"]),
        "block_size_sweep": sweep,
        "kernel_speed": speed,
    }
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

    p, c = report["paged"], report["contiguous"]
    table = Table(title=f"KV memory at {report['budget_bytes'] / 2**20:.0f} MiB, "
                        f"max_model_len {report['max_model_len']}")
    for col in ("layout", "max concurrency", "live / allocated slots", "live / budget"):
        table.add_column(col, justify="right")
    layouts = [("contiguous", c), (f"paged (block {p['block_size']})", p)]
    if "paged_fp8_kv" in report:
        layouts.append((f"paged, fp8 KV (block {p['block_size']})", report["paged_fp8_kv"]))
    for name, r in layouts:
        table.add_row(name, str(r["max_concurrency"]),
                      f"{100 * r['live_fraction_of_allocated']:.1f}%",
                      f"{100 * r['live_fraction_of_budget']:.1f}%")
    Console().print(table)
    sweep = Table(title="block-size sweep")
    for col in ("block", "concurrency", "tail waste", "decode GB/s by backend"):
        sweep.add_column(col, justify="right")
    rows = report["kernel_speed"]["rows"]
    for r in report["block_size_sweep"]:
        speeds = ", ".join(f"{k['backend']} {k['kv_GBps']:.1f}" for k in rows
                           if k["block_size"] == r["block_size"] and "kv_GBps" in k)
        sweep.add_row(str(r["block_size"]), str(r["max_concurrency"]),
                      f"{100 * r['tail_waste_fraction']:.2f}%", speeds or "-")
    Console().print(sweep)
