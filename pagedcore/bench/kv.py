"""`pagedcore bench kv`: KV-cache bookkeeping costs and a paged-vs-contiguous trace simulation.

Figures:

- allocate + free per block: the block pool alone, and `KVCacheManager.allocate_slots` + `free`
  (prefix caching off, so no hashing) for one 16K-token request;
- prefix lookup per block: `get_computed_blocks` on a fully cached 32K-token prompt whose hashes
  are already computed (the hash-map walk alone);
- hashing a 32K-token prompt (block 16) with sha256 and with xxhash;
- the trace simulation of `pagedcore.bench.kv_trace` (paged vs contiguous at equal memory).
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import click

from pagedcore.cli_progress import progress_bar

__all__ = ["kv", "run_kv_bench"]

BLOCK = 16
PROMPT_32K = 32 * 1024


class _Req:
    """Minimal KVRequest."""

    def __init__(self, rid: str, tokens: list[int]) -> None:
        self.request_id = rid
        self.tokens = tokens
        self.num_computed_tokens = 0
        self.cache_salt: str | None = None
        self.lora_name: str | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.tokens)


def _seconds(fn: Callable[[], None], repeats: int) -> tuple[float, float]:
    """(best, median) wall time of ``fn`` over ``repeats`` runs."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def _config(num_blocks: int) -> Any:
    from pagedcore.kv_cache.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=8, head_size=128, dtype="bfloat16")
    group = KVCacheGroupSpec(layer_names=("model.layers.0.self_attn",), spec=spec)
    return KVCacheConfig(num_blocks=num_blocks, groups=(group,))


def bench_alloc_free(repeats: int) -> dict[str, float]:
    """Nanoseconds per block for pool-level and manager-level allocate + free."""
    from pagedcore.kv_cache.block_pool import BlockPool
    from pagedcore.kv_cache.manager import KVCacheManager

    n = 1024  # blocks per allocation: a 16K-token request
    pool = BlockPool(4 * n + 1)

    def pool_round() -> None:
        blocks = pool.get_new_blocks(n)
        pool.free_blocks(reversed(blocks))

    mgr = KVCacheManager(_config(4 * n + 1), 64 * 1024, enable_caching=False)
    req = _Req("a", [0] * (n * BLOCK))

    def manager_round() -> None:
        mgr.allocate_slots(req, n * BLOCK)
        mgr.free(req)

    pool_best, pool_med = _seconds(pool_round, repeats)
    mgr_best, mgr_med = _seconds(manager_round, repeats)
    return {
        "pool_ns_per_block": pool_best / n * 1e9,
        "pool_ns_per_block_median": pool_med / n * 1e9,
        "manager_ns_per_block": mgr_best / n * 1e9,
        "manager_ns_per_block_median": mgr_med / n * 1e9,
    }


def bench_prefix_lookup(repeats: int) -> dict[str, float]:
    """Nanoseconds per hit block for a fully cached 32K-token prompt (hashes precomputed)."""
    from pagedcore.kv_cache.manager import KVCacheManager

    num_blocks = PROMPT_32K // BLOCK
    mgr = KVCacheManager(_config(num_blocks + 8), PROMPT_32K * 2, hash_seed=0)
    tokens = random.Random(0).choices(range(150_000), k=PROMPT_32K + 1)
    owner = _Req("owner", tokens)
    assert mgr.allocate_slots(owner, len(tokens)) is not None
    probe = _Req("probe", tokens)
    _, hit = mgr.get_computed_blocks(probe)  # hashes the probe once
    assert hit == PROMPT_32K, hit

    def lookup() -> None:
        mgr.get_computed_blocks(probe)

    best, med = _seconds(lookup, repeats)
    return {"ns_per_block": best / num_blocks * 1e9, "ns_per_block_median": med / num_blocks * 1e9}


def bench_hashing(repeats: int) -> dict[str, float | None]:
    """Milliseconds to hash every full block of a 32K-token prompt."""
    from pagedcore.kv_cache.hashing import BlockHasher, make_hash_function, root_hash

    req = _Req("h", random.Random(1).choices(range(150_000), k=PROMPT_32K))
    out: dict[str, float | None] = {}
    for algo in ("sha256", "xxhash"):
        try:
            fn = make_hash_function(algo)
        except ImportError:
            out[f"{algo}_ms"] = out[f"{algo}_ms_median"] = None
            continue
        root = root_hash(fn, 0)

        def run(fn: Callable[[bytes], bytes] = fn, root: bytes = root) -> None:
            BlockHasher(BLOCK, fn, root).hashes("h", req)

        best, med = _seconds(run, repeats)
        out[f"{algo}_ms"], out[f"{algo}_ms_median"] = best * 1e3, med * 1e3
    return out


def run_kv_bench(*, repeats: int, num_requests: int, seed: int) -> dict[str, Any]:
    """Run every KV benchmark; return the JSON-ready figures."""
    from pagedcore.bench.kv_trace import (
        TraceParams,
        make_trace,
        simulate_contiguous,
        simulate_paged,
    )

    params = TraceParams(num_requests=num_requests, seed=seed)
    trace = make_trace(params)
    t0 = time.perf_counter()
    paged = simulate_paged(params, trace)
    sim_seconds = time.perf_counter() - t0
    contiguous = simulate_contiguous(params, trace)
    prompts = [p for p, _ in trace]
    outputs = [o for _, o in trace]
    return {
        "command": " ".join(["pagedcore", "bench", "kv", *sys.argv[sys.argv.index("kv") + 1 :]])
        if "kv" in sys.argv
        else "pagedcore bench kv",
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        },
        "block_size": BLOCK,
        "timing": f"best of {repeats} runs (medians in *_median)",
        "allocate_free": bench_alloc_free(repeats),
        "prefix_lookup": bench_prefix_lookup(repeats),
        "hash_32k_prompt": bench_hashing(repeats),
        "trace": {
            "params": attrs.asdict(params),
            "distribution": (
                "lognormal, sigma 1.0, means 161 prompt / 338 output tokens (ShareGPT means "
                "reported by the vLLM paper; sigma chosen, not fitted), clipped to max_model_len"
            ),
            "observed_prompt_mean": statistics.fmean(prompts),
            "observed_output_mean": statistics.fmean(outputs),
            "paged": attrs.asdict(paged),
            "contiguous": attrs.asdict(contiguous),
            "paged_sim_seconds": sim_seconds,
        },
    }


def _print_table(figures: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    af, pl, hs, tr = (figures[k] for k in ("allocate_free", "prefix_lookup", "hash_32k_prompt",
                                           "trace"))
    table = Table(title="pagedcore bench kv (times: best of runs)", show_lines=False)
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("target", justify="right")
    table.add_row("allocate+free per block (pool)", f"{af['pool_ns_per_block']:.0f} ns", "")
    table.add_row("allocate+free per block (manager)", f"{af['manager_ns_per_block']:.0f} ns",
                  "< 1000 ns")
    table.add_row("prefix lookup per block", f"{pl['ns_per_block']:.0f} ns", "")
    for algo, target in (("sha256", "< 5 ms"), ("xxhash", "")):
        ms = hs[f"{algo}_ms"]
        table.add_row(f"hash 32K-token prompt ({algo})",
                      "not installed" if ms is None else f"{ms:.2f} ms", target)
    for policy in ("paged", "contiguous"):
        r = tr[policy]
        table.add_row(f"{policy}: reserved slots holding live tokens",
                      f"{100 * r['live_fraction']:.1f} %", ">= 95 %" if policy == "paged" else "")
        table.add_row(f"{policy}: max / mean-while-saturated concurrent requests",
                      f"{r['max_concurrent']} / {r['mean_concurrent_saturated']:.1f}", "")
        table.add_row(f"{policy}: steps to drain trace (preemptions)",
                      f"{r['steps']} ({r['preemptions']})", "")
    Console().print(table)


@click.command("kv")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="Write the figures to this JSON file.")
@click.option("--repeats", type=click.IntRange(1), default=15, show_default=True,
              help="Timing repetitions (best and median are reported).")
@click.option("--requests", "num_requests", type=click.IntRange(1), default=1000,
              show_default=True, help="Requests in the simulated trace.")
@click.option("--seed", type=int, default=0, show_default=True, help="Trace seed.")
def kv(json_path: Path | None, repeats: int, num_requests: int, seed: int) -> None:
    """KV-cache bookkeeping costs and paged vs contiguous allocation on a simulated trace."""
    with progress_bar("bench kv", None):
        figures = run_kv_bench(repeats=repeats, num_requests=num_requests, seed=seed)
    _print_table(figures)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(figures, indent=2) + "\n")
        click.echo(f"wrote {json_path}")
