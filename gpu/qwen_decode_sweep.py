"""Decode tile / split-plan sweep of the triton backend at the Qwen2-0.5B attention shape.

    python3 gpu/qwen_decode_sweep.py OUT.json [--shape 256x560] [--layers 6] [--heads 14/2]
        [--head-size 64] [--tiles 'T;T..'] [--fp8-tiles 'T;T..'] [--rules uniform,balanced]

Issue 22's 0.5B decode step at batch 256 spends 0.78 ms of its 2.02 ms of kernels in paged
attention at 53 % of the copy bandwidth (14 query / 2 KV heads, head size 64, ~560 tokens of
context). This sweeps ``PAGEDCORE_TRITON_DECODE_TILES`` x split rules (the builder's
`SplitRule`: the eager default; the balanced plan that decode CUDA graphs capture, from
``build_for_cudagraph_capture``, run eagerly; finer balanced splits) on that
shape, and times cuda_paged's decode on the same caches when it is installed. Each variant
is first checked against SDPA on the contiguous K/V (relative error in the JSON; a variant
above 2e-2 is reported and not timed), then timed as the engine runs it: one launch per
layer over `--layers` separate caches (together larger than L2), back to back between CUDA
events, behind a GPU spin that lets the host queue them all (device time, not launch
cost). The variants are timed round-robin, `--rounds` samples each (after 2 s of copies
that warm the clocks), so clock drift hits all alike; the JSON has each one's median, min
and max.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

TILES = ["", "32,4,3", "32,2,3", "64,4,4", "128,4,3", "64,2,3"]
#: name -> SplitRule fields: the eager default (uniform), the captured default (balanced), and
#: finer splits (more programs than the default budget of 512).
RULES = {
    "uniform": {},
    "balanced": {"balanced": True},
    "balanced_t1024_m128": {"balanced": True, "target_programs": 1024,
                            "min_tokens_per_segment": 128},
    "balanced_t2048_m64": {"balanced": True, "target_programs": 2048,
                           "min_tokens_per_segment": 64},
    "uniform_p2048_m128": {"min_programs": 2048, "target_programs": 2048,
                           "min_tokens_per_segment": 128},
}


def main() -> None:
    import attrs
    import torch
    from pagedcore_triton.plan import SplitRule

    from pagedcore.bench.kernel_primitives import BackendUnderTest, PagedKV, rel_error

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out")
    parser.add_argument("--shape", default="256x560")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--heads", default="14/2", help="query/KV heads")
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--tiles", default=";".join(TILES),
                        help="bf16 decode tile texts, ';'-separated ('' = the default)")
    parser.add_argument("--fp8-tiles", default="",
                        help="fp8 decode tile texts swept under the uniform rule, "
                             "';'-separated ('' = the default only)")
    parser.add_argument("--rules", default=",".join(RULES), help="split rules, ','-separated")
    args = parser.parse_args()
    batch, ctx = (int(x) for x in args.shape.split("x"))
    hq, hkv = (int(x) for x in args.heads.split("/"))
    d = args.head_size
    tiles_list = args.tiles.split(";")
    fp8_tiles = args.fp8_tiles.split(";")
    rules = {name: RULES[name] for name in args.rules.split(",")}
    dev = torch.device("cuda")
    torch.manual_seed(0)
    caches = [PagedKV([ctx] * batch, torch.bfloat16, dev, num_kv_heads=hkv, head_size=d)
              for _ in range(args.layers)]
    query = torch.randn((batch, hq, d), dtype=torch.bfloat16, device=dev)
    kv = caches[0]
    k4 = kv.key.view(batch, ctx, hkv, d).transpose(1, 2)
    v4 = kv.value.view(batch, ctx, hkv, d).transpose(1, 2)
    ref = torch.nn.functional.scaled_dot_product_attention(
        query.view(batch, 1, hq, d).transpose(1, 2), k4, v4, enable_gqa=True
    ).transpose(1, 2).reshape(query.shape)
    nbytes = 2 * batch * ctx * hkv * d * 2  # bf16 K + V of one layer

    def set_env(tiles: str) -> None:
        os.environ.pop("PAGEDCORE_TRITON_DECODE_PLAN", None)
        if tiles:
            os.environ["PAGEDCORE_TRITON_DECODE_TILES"] = tiles
        else:
            os.environ.pop("PAGEDCORE_TRITON_DECODE_TILES", None)

    def build(backend_cls, kv_dtype: str, tiles: str = "", rule: dict | None = None):
        """The variant's per-layer launches (checked on layer 0) and its relative error."""
        set_env(tiles)
        unders = [BackendUnderTest(backend_cls, c, kv_cache_dtype=kv_dtype, num_heads=hq)
                  for c in caches]
        if rule is not None:
            for u in unders:
                u.builder.split_rule = attrs.evolve(SplitRule(), **rule)
        if rule is not None and rule.get("balanced"):
            # The plan decode CUDA graphs capture (an eager launch of equal lengths would take
            # the uniform plan: `balanced_pays`), run eagerly.
            runs = [u.capture_runner(c, list(range(batch)), query, max_seq_len=ctx)
                    for u, c in zip(unders, caches, strict=True)]
        else:
            runs = [u.runner(c, [1] * batch, list(range(batch)), query)
                    for u, c in zip(unders, caches, strict=True)]
        err = rel_error(runs[0](), ref)
        for r in runs:
            r()
        return runs, err

    def sample(runs, tiles: str) -> float:
        set_env(tiles)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # A 20 ms spin (~2e6 cycles per ms) while the host queues the 60 launches, so the
        # figure is device time, not the launches' Python (as `time_ms` does).
        torch.cuda._sleep(40_000_000)
        s.record()
        for _ in range(10):
            for r in runs:
                r()
        e.record()
        torch.cuda.synchronize()
        return s.elapsed_time(e) / (10 * len(runs))

    from pagedcore_triton.backend import TritonAttentionBackend

    variants = []  # (row, runs, tiles)

    def add(row: dict, backend_cls, kv_dtype: str, tiles: str = "", rule: dict | None = None,
            max_err: float = 2e-2) -> None:
        """Build one variant, record its error; a variant that fails or is wrong stays a row
        without timings."""
        try:
            runs, err = build(backend_cls, kv_dtype, tiles, rule)
        except Exception as exc:  # a variant that fails is a result
            row["error"] = repr(exc)[:300]
            variants.append((row, None, tiles))
            return
        row["rel_err"] = err
        variants.append((row, runs if err < max_err else None, tiles))

    for rule_name, rule in rules.items():
        for tiles in tiles_list:
            add({"backend": "triton", "kv": "auto", "rule": rule_name,
                 "tiles": tiles or "default"}, TritonAttentionBackend, "auto", tiles, rule)
    for tiles in fp8_tiles:
        add({"backend": "triton", "kv": "fp8", "rule": "uniform", "tiles": tiles or "default"},
            TritonAttentionBackend, "fp8", tiles, max_err=6e-2)
    try:
        from pagedcore_cuda_paged import CudaPagedBackend
    except ImportError:
        pass
    else:
        for kv_dtype in ("auto", "fp8"):
            add({"backend": "cuda_paged", "kv": kv_dtype, "rule": "default",
                 "tiles": "default"}, CudaPagedBackend, kv_dtype, max_err=6e-2)

    copy_src = torch.empty(nbytes * args.layers // 2, dtype=torch.int16, device=dev)
    copy_dst = torch.empty_like(copy_src)
    t_end = time.time() + 2.0  # warm the clocks
    while time.time() < t_end:
        copy_dst.copy_(copy_src)
        torch.cuda.synchronize()
    copy_ms = []
    samples: list[list[float]] = [[] for _ in variants]
    for _ in range(args.rounds):  # round-robin, so drift hits every variant alike
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(5):
            copy_dst.copy_(copy_src)
        e.record()
        torch.cuda.synchronize()
        copy_ms.append(s.elapsed_time(e) / 5)
        for i, (_, runs, tiles) in enumerate(variants):
            if runs is not None:
                samples[i].append(sample(runs, tiles))
    copy_gbps = 2 * copy_src.numel() * 2 / statistics.median(copy_ms) / 1e6
    rows = []
    for (row, _runs, _), ts in zip(variants, samples, strict=True):
        if ts:
            ms = statistics.median(ts)
            row.update(ms=ms, ms_min=min(ts), ms_max=max(ts),
                       GBps=(nbytes / (1 if row["kv"] == "auto" else 2)) / ms / 1e6)
            row["pct_copy"] = 100 * row["GBps"] / copy_gbps
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(args.out, "w") as fh:
        json.dump({"rows": rows, "shape": args.shape, "heads": args.heads, "head_size": d,
                   "layers": args.layers, "rounds": args.rounds, "copy_GBps": copy_gbps,
                   "device": torch.cuda.get_device_name(),
                   "commit": os.environ.get("PAGEDCORE_GIT_COMMIT")}, fh, indent=1)


if __name__ == "__main__":
    main()
