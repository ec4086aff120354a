"""Decode steps with skewed and uniform lengths: the uniform split-KV plan vs the balanced one.

Usage: ``python backends/triton/bench/skewed_decode.py OUT.json [--small] [--no-time]
[--cases A,B] [--plans X,Y]``

Cases (bf16, 32 query / 8 KV heads, head size 128, block size 16, blocks randomly permuted):

* ``skewed21``: one request of 32,768 tokens and 20 of 128-1024 (the slow step of
  ``docs/benchmarks/h200_s5/chunked_8b.json``), CUDA graph bucket 24;
* ``skewed64``: one of 32,768 and 63 of 128-1024, bucket 64;
* ``uniform``: 64x4096, 8x32768, 256x1024 (buckets of the batch size).

Each runs eager (`build`) and replayed from a CUDA graph (`build_for_cudagraph_capture` for
the bucket, ``max_seq_len`` 33,792 = the engine's ``max_model_len``; padding requests as the
engine pads them: length 1 on the null block, slot -1), once per plan (`PLANS`): ``uniform``
(the default `SplitRule`), ``balanced`` (``SplitRule(balanced=True)``, the default program
order; not run by default), ``balanced_req``, ``balanced_heads``, ``balanced_rr``,
``balanced_rr_heads`` (each program order of ``PAGEDCORE_TRITON_BALANCED_ORDER``) and
``balanced_t1024`` (a split budget of 1024 programs; not run by default). A row holds
microseconds per call (`pagedcore.bench.kernel_primitives.time_ms` / `graph_time_ms`: device
time, L2 flushed), GB/s of K/V actually read (the real requests' tokens) and its share of
the device-to-device copy bandwidth measured in the same run, and the relative error of the
real rows against float32 SDPA per request (``rel_err``: the first call; ``rel_err_replay``:
the output after the graph's replays, the output buffer NaN-filled before capture).
``--small`` shrinks everything and times nothing (a logic check; runs on CPU under
``TRITON_INTERPRET=1``, the capture plan run eagerly); ``--no-time`` keeps the shapes but
times nothing (compiles every kernel variant, e.g. beside other work before the timed run).
The JSON is rewritten after every row.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import torch

from pagedcore.attention import CommonAttentionMetadata
from pagedcore.bench.kernel_primitives import (
    HEAD_SIZE,
    NUM_HEADS,
    NUM_KV_HEADS,
    BackendUnderTest,
    PagedKV,
    copy_bandwidth_gbps,
    graph_time_ms,
    time_ms,
)

MAX_MODEL_LEN = 33792
#: plan -> (SplitRule fields, PAGEDCORE_TRITON_BALANCED_ORDER); "balanced" = the default order.
PLANS: dict[str, tuple[dict[str, Any], str | None]] = {
    "uniform": ({}, None),
    "balanced": ({"balanced": True}, None),
    "balanced_req": ({"balanced": True}, "req"),
    "balanced_heads": ({"balanced": True}, "heads"),
    "balanced_rr": ({"balanced": True}, "rr"),
    "balanced_rr_heads": ({"balanced": True}, "rr_heads"),
    "balanced_t1024": ({"balanced": True, "target_programs": 1024}, None),
}
#: The plans timed unless ``--plans`` names others.
DEFAULT_PLANS = ["uniform", "balanced_req", "balanced_heads", "balanced_rr", "balanced_rr_heads"]


def _cases(small: bool) -> dict[str, tuple[list[int], int]]:
    """name -> (seq_lens, bucket), most informative first."""
    rng = random.Random(0)
    short = (16, 128) if small else (128, 1024)
    long_len = 300 if small else 32768

    def skewed(n: int) -> list[int]:
        return [long_len] + [rng.randint(*short) for _ in range(n - 1)]

    if small:
        return {"skewed21": (skewed(5), 8), "uniform_2x64": ([64] * 2, 2)}
    skewed21, skewed64 = skewed(21), skewed(64)
    return {
        "uniform_8x32768": ([32768] * 8, 8),
        "skewed21": (skewed21, 24),
        "uniform_64x4096": ([4096] * 64, 64),
        "uniform_256x1024": ([1024] * 256, 256),
        "skewed64": (skewed64, 64),
    }


def _reference(kv: PagedKV, query: torch.Tensor) -> torch.Tensor:
    """``[n, Hq, D]`` float32 attention of each request's one query token over its K/V."""
    import torch.nn.functional as F

    outs = []
    for r in range(len(kv.seq_lens)):
        sl = kv.token_slice(r)
        k = kv.key[sl].float().transpose(0, 1)[None]
        v = kv.value[sl].float().transpose(0, 1)[None]
        q = query[r : r + 1].float().transpose(0, 1)[None]
        outs.append(F.scaled_dot_product_attention(q, k, v, enable_gqa=True)[0, :, 0])
    return torch.stack(outs)


def _padded(common: CommonAttentionMetadata, bucket: int) -> CommonAttentionMetadata:
    """`common` padded to `bucket` single-token requests the way the engine pads a decode
    step for its graph (length 1, null-block row, slot -1), planned for `MAX_MODEL_LEN`."""
    n = common.num_reqs
    dev = common.seq_lens.device
    seq = torch.ones(bucket, dtype=torch.int32)
    seq[:n] = common.seq_lens_cpu
    table = torch.zeros((bucket, -(-MAX_MODEL_LEN // 16)), dtype=torch.int32, device=dev)
    width = min(table.shape[1], common.block_table.shape[1])
    table[:n, :width] = common.block_table[:, :width]
    slots = torch.full((bucket,), -1, dtype=torch.int64, device=dev)
    slots[:n] = common.slot_mapping
    qsl = torch.arange(bucket + 1, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(dev), query_start_loc_cpu=qsl, seq_lens=seq.to(dev),
        seq_lens_cpu=seq, num_reqs=bucket, num_actual_tokens=bucket, max_query_len=1,
        max_seq_len=MAX_MODEL_LEN, block_table=table, slot_mapping=slots,
        positions=torch.zeros(bucket, dtype=torch.int64, device=dev),
    )


def _plan_info(metadata: Any) -> dict[str, Any]:
    (part,) = metadata.parts
    return {"segments": part.num_segments, "balanced_programs": part.balanced_programs}


def _measure(
    under: BackendUnderTest, kv: PagedKV, query: torch.Tensor, ref: torch.Tensor, *,
    mode: str, bucket: int, timed: bool,
) -> dict[str, Any]:
    """Plan one step (eager, or for the `bucket`'s graph), check it, time it."""
    n = len(kv.seq_lens)
    dev = query.device
    reqs = list(range(n))
    if mode == "eager":
        metadata = under.builder.build(kv.common([1] * n, reqs))
        q = query[:n]
    else:
        metadata = under.builder.build_for_cudagraph_capture(
            _padded(kv.common([1] * n, reqs), bucket)
        )
        q = query
    idx = kv.new_tokens([1] * n, reqs)
    pad = q.shape[0] - n
    key = torch.cat([kv.key[idx], kv.key[idx[:1]].expand(pad, -1, -1)])
    value = torch.cat([kv.value[idx], kv.value[idx[:1]].expand(pad, -1, -1)])
    out = torch.empty_like(q)
    impl, cache = under.impl, under.kv_cache

    def call() -> Any:
        return impl.forward(q, key, value, cache, metadata, output=out)

    def err() -> float:
        return float((out[:n].float() - ref).norm() / ref.norm())

    call()
    row: dict[str, Any] = {**_plan_info(metadata), "rel_err": err()}
    if not timed:  # one call checks the logic (and compiles the kernels)
        row["us"] = float("nan")
    elif mode == "graph":
        out.fill_(float("nan"))
        row["us"] = 1e3 * graph_time_ms(call, dev)
        row["rel_err_replay"] = err()
    else:
        row["us"] = 1e3 * time_ms(call, dev)
    return row


def run(
    out_path: Path, *, small: bool, only: set[str] | None, timed: bool = True,
    plans: list[str] | None = None,
) -> None:
    from pagedcore_triton import SplitRule, TritonAttentionBackend
    from pagedcore_triton.backend import DECODE_PLAN_ENV
    from pagedcore_triton.plan import BALANCED_ORDER_ENV

    os.environ.pop(DECODE_PLAN_ENV, None)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    timed = timed and not small
    plans = plans or DEFAULT_PLANS
    report: dict[str, Any] = {"device": torch.cuda.get_device_name() if dev.type == "cuda"
                              else "cpu", "rows": []}
    t0 = time.time()
    copy = copy_bandwidth_gbps(dev, quick=not timed)
    report["copy_bandwidth_GBps"] = copy
    print(f"copy bandwidth {copy:.0f} GB/s", flush=True)
    for name, (lens, bucket) in _cases(small).items():
        if only and name not in only:
            continue
        kv = PagedKV(lens, dtype, dev)
        under = BackendUnderTest(TritonAttentionBackend, kv)
        n = len(lens)
        query = torch.randn((bucket, NUM_HEADS, HEAD_SIZE), dtype=dtype, device=dev)
        ref = _reference(kv, query)
        kv_bytes = 2 * sum(lens) * NUM_KV_HEADS * HEAD_SIZE * dtype.itemsize
        for plan in plans:
            builder: Any = under.builder
            fields, order = PLANS[plan]
            builder.split_rule = attrs.evolve(SplitRule(), **fields)
            os.environ.pop(BALANCED_ORDER_ENV, None)  # read when the first call prepares
            if order is not None:
                os.environ[BALANCED_ORDER_ENV] = order
            modes = ["eager", "graph"] if dev.type == "cuda" else ["eager", "capture-plan"]
            for mode in modes:
                row: dict[str, Any] = {"case": name, "n": n, "bucket": bucket, "plan": plan,
                                       "mode": mode, "kv_bytes": kv_bytes}
                try:
                    row.update(_measure(under, kv, query, ref, mode=mode, bucket=bucket,
                                        timed=timed))
                    ms = row["us"] / 1e3
                    row.update({"kv_GBps": kv_bytes / ms / 1e6,
                                "pct_copy": 100 * kv_bytes / ms / 1e6 / copy})
                except Exception as exc:  # one failing variant must not sink the others
                    row["error"] = f"{type(exc).__name__}: {exc}"
                row["t_s"] = round(time.time() - t0, 1)
                report["rows"].append(row)
                print(json.dumps(row), flush=True)
                out_path.write_text(json.dumps(report, indent=1))
        del under, kv
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    _summary(report)
    out_path.write_text(json.dumps(report, indent=1))


def _summary(report: dict[str, Any]) -> None:
    """Print ``case mode: plan us (time / uniform's) ...`` per case and mode."""
    by: dict[tuple[str, str], dict[str, float]] = {}
    for r in report["rows"]:
        if "us" in r:
            by.setdefault((r["case"], r["mode"]), {})[r["plan"]] = r["us"]
    for (case, mode), plans in by.items():
        base = plans.get("uniform")
        text = "  ".join(
            f"{p} {us:7.1f}" + (f" ({us / base:.3f})" if base and p != "uniform" else "")
            for p, us in plans.items()
        )
        print(f"{case:16s} {mode:5s} us: {text}", flush=True)
    report["summary"] = {f"{c}/{m}": p for (c, m), p in by.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--small", action="store_true", help="tiny shapes (logic check)")
    parser.add_argument("--cases", default="", help="comma-separated case names (default all)")
    parser.add_argument("--plans", default="",
                        help=f"comma-separated plans of {', '.join(PLANS)} (default "
                        f"{','.join(DEFAULT_PLANS)})")
    parser.add_argument("--no-time", action="store_true",
                        help="one call per variant (checks; compiles the kernels for a later run)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():  # before pagedcore_triton imports triton
        os.environ.setdefault("TRITON_INTERPRET", "1")
    only = set(args.cases.split(",")) if args.cases else None
    plans = args.plans.split(",") if args.plans else None
    if plans and set(plans) - set(PLANS):
        parser.error(f"unknown plans {sorted(set(plans) - set(PLANS))}; known: {list(PLANS)}")
    run(args.out, small=args.small, only=only, timed=not args.no_time, plans=plans)
    return 0


if __name__ == "__main__":
    sys.exit(main())
