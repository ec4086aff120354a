"""Stream vs CUDA-graph timing of the shipped MLA forward (decode + merge) at the bench shapes.

Session 8 (issue 8), on the H200 with pagedcore and pagedcore-triton installed:

    python3 docs/benchmarks/h200_s8/graph_check.py OUT.json [VARIANT ...]

(variants: keys of `pagedcore_triton.mla_config.MLA_KERNEL_CONFIGS`; the shipped default
when none are named).

Per shape: `time_ms` (back-to-back launches, the MLA bench's method) and `graph_time_ms` (a
captured CUDA graph of 10 calls, timed like `time_ms`); the graph's output is checked against
the eager one. (The session-8 JSONs came from this script at the commits named in README.md,
which timed a graph of 20 calls with an L2 flush before each replay.) Also an empty Triton
kernel of 256 programs timed both ways (the launch cost each way).
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl
from pagedcore_triton.mla import DEFAULT_MLA_KERNEL
from pagedcore_triton.mla_config import MLA_KERNEL_CONFIGS

from pagedcore.bench.kernel_primitives import copy_bandwidth_gbps, graph_time_ms, time_ms
from pagedcore.bench.mla_kernel import (
    FULL_CASES,
    LATENT,
    NUM_HEADS,
    ROPE,
    _decode_batch,
    _impl,
    _plans,
)


@triton.jit
def _noop(x_ptr):  # type: ignore[no-untyped-def]
    pid = tl.program_id(0)
    tl.store(x_ptr + pid, pid)


def _capture(fn: Callable[[], Any], device: torch.device) -> tuple[Any, Any]:
    """A CUDA graph of one call of `fn` (warmed up on a side stream first), and its result."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result


def main(path: str, variants: list[str]) -> None:
    dev = torch.device("cuda")
    copy = copy_bandwidth_gbps(dev, quick=False)
    x = torch.zeros(4096, dtype=torch.int32, device=dev)
    out: dict[str, Any] = {
        "copy_bandwidth_GBps": copy,
        "noop256_stream_ms": time_ms(lambda: _noop[(256,)](x), dev),
        "noop256_graph_ms": graph_time_ms(lambda: _noop[(256,)](x), dev),
        "rows": [],
    }
    configs = [MLA_KERNEL_CONFIGS[v] for v in variants] or [DEFAULT_MLA_KERNEL]
    for (batch, context), config in ((shape, c) for shape in FULL_CASES for c in configs):
        cache, query, common = _decode_batch(batch, context, dev, torch.bfloat16)
        meta, _ = _plans(common, dev, torch.bfloat16)
        impl = _impl(config)
        launch = impl.plan_launch(query, meta)
        o = query.new_empty(batch, NUM_HEADS, LATENT)

        def fwd(impl: Any = impl, query: torch.Tensor = query, cache: torch.Tensor = cache,
                meta: Any = meta) -> torch.Tensor:
            return impl.forward(query, query, query, cache, meta)  # type: ignore[no-any-return]

        dec = functools.partial(impl.launch_decode, launch, query, cache, meta, o)
        want = fwd().float().clone()
        kv = batch * context * (LATENT + ROPE) * 2
        part = 0 if launch.splits == 1 else batch * NUM_HEADS * launch.splits * (LATENT * 2 + 8) * 2
        row: dict[str, Any] = {
            "variant": config.name, "batch": batch, "context": context,
            "splits": launch.splits, "kv_bytes": kv,
            "partial_bytes_written_and_read": part,
            "forward_stream_ms": time_ms(fwd, dev), "decode_stream_ms": time_ms(dec, dev),
            "forward_graph_ms": graph_time_ms(fwd, dev),
            "decode_graph_ms": graph_time_ms(dec, dev),
        }
        graph, got = _capture(fwd, dev)
        graph.replay()
        torch.cuda.synchronize(dev)
        row["graph_rel_err_vs_eager"] = float((got.float() - want).norm() / want.norm())
        for key in [k for k in row if k.endswith("_ms")]:
            row[key[:-3] + "_pct_copy"] = 100 * kv / row[key] / 1e6 / copy
        print(json.dumps(row), flush=True)
        out["rows"].append(row)
        del cache, query
    with open(path, "w") as fh:
        json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
