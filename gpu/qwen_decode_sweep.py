"""Decode tile / split-plan sweep of the triton backend at the Qwen2-0.5B attention shape.

    python3 gpu/qwen_decode_sweep.py OUT.json [--shape 256x560] [--layers 6]

Issue 22's 0.5B decode step at batch 256 spends 0.78 ms of its 2.02 ms of kernels in paged
attention at 53 % of the copy bandwidth (14 query / 2 KV heads, head size 64, ~560 tokens of
context). This sweeps ``PAGEDCORE_TRITON_DECODE_TILES`` x ``PAGEDCORE_TRITON_DECODE_PLAN`` (both
read per launch build) on that shape, and times cuda_paged's decode on the same caches when it
is installed. Each variant is first checked against SDPA on the contiguous K/V (relative
error in the JSON; a variant above 2e-2 is reported and not timed), then timed as the engine
runs it: one launch per layer over `--layers` separate caches (together larger than L2),
back to back between CUDA events, the median of 15 such runs per launch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

TILES = ["", "32,4,3", "32,2,3", "64,2,3", "64,4,2", "64,4,4", "128,4,3", "128,8,3", "16,2,3",
         "32,4,4"]
PLANS = ["uniform", "balanced", "balanced:128", "balanced:64"]


def main() -> None:
    import torch

    from pagedcore.bench.kernel_primitives import BackendUnderTest, PagedKV, rel_error

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out")
    parser.add_argument("--shape", default="256x560")
    parser.add_argument("--layers", type=int, default=6)
    args = parser.parse_args()
    batch, ctx = (int(x) for x in args.shape.split("x"))
    hq, hkv, d = 14, 2, 64
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

    def measure(backend_cls, kv_dtype: str) -> tuple[float, float]:
        unders = [BackendUnderTest(backend_cls, c, kv_cache_dtype=kv_dtype, num_heads=hq)
                  for c in caches]
        runs = [u.runner(c, [1] * batch, list(range(batch)), query)
                for u, c in zip(unders, caches, strict=True)]
        err = rel_error(runs[0](), ref)
        if err > 2e-2 and kv_dtype == "auto":
            return err, float("nan")
        for r in runs:
            r()
        samples = []
        for _ in range(15):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(4):
                for r in runs:
                    r()
            e.record()
            torch.cuda.synchronize()
            samples.append(s.elapsed_time(e) / (4 * len(runs)))
        return err, statistics.median(samples)

    rows = []
    from pagedcore_triton.backend import TritonAttentionBackend

    def record(**row) -> None:
        row["GBps"] = (nbytes / (1 if row["kv"] == "auto" else 2)) / row["ms"] / 1e6 \
            if row["ms"] == row["ms"] else None
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(args.out, "w") as fh:
            json.dump({"rows": rows, "shape": args.shape, "heads": "14/2", "head_size": d,
                       "layers": args.layers, "device": torch.cuda.get_device_name(),
                       "commit": os.environ.get("PAGEDCORE_GIT_COMMIT")}, fh, indent=1)

    copy_src = torch.empty(nbytes * args.layers // 2, dtype=torch.int16, device=dev)
    copy_dst = torch.empty_like(copy_src)
    copy_dst.copy_(copy_src)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        copy_dst.copy_(copy_src)
    e.record()
    torch.cuda.synchronize()
    copy_gbps = 2 * copy_src.numel() * 2 * 10 / s.elapsed_time(e) / 1e6
    print(f"copy {copy_gbps:.0f} GB/s (read + write)", flush=True)

    for plan in PLANS:
        for tiles in TILES:
            os.environ["PAGEDCORE_TRITON_DECODE_PLAN"] = plan
            if tiles:
                os.environ["PAGEDCORE_TRITON_DECODE_TILES"] = tiles
            else:
                os.environ.pop("PAGEDCORE_TRITON_DECODE_TILES", None)
            t0 = time.time()
            try:
                err, ms = measure(TritonAttentionBackend, "auto")
            except Exception as exc:  # a variant that fails is a result
                record(backend="triton", kv="auto", plan=plan, tiles=tiles, ms=float("nan"),
                       rel_err=None, error=repr(exc)[:300])
                continue
            record(backend="triton", kv="auto", plan=plan, tiles=tiles or "default", ms=ms,
                   rel_err=err, copy_GBps=copy_gbps, secs=round(time.time() - t0, 1))
    os.environ.pop("PAGEDCORE_TRITON_DECODE_TILES", None)
    os.environ.pop("PAGEDCORE_TRITON_DECODE_PLAN", None)
    others = [("triton", TritonAttentionBackend, "fp8")]
    try:
        from pagedcore_cuda_paged import CudaPagedBackend
    except ImportError:
        pass
    else:
        others += [("cuda_paged", CudaPagedBackend, kv) for kv in ("auto", "fp8")]
    for name, cls, kv_dtype in others:
        try:
            err, ms = measure(cls, kv_dtype)
        except Exception as exc:  # a backend that fails is a result
            record(backend=name, kv=kv_dtype, plan="default", tiles="default", ms=float("nan"),
                   rel_err=None, error=repr(exc)[:300])
            continue
        record(backend=name, kv=kv_dtype, plan="default", tiles="default", ms=ms,
               rel_err=err, copy_GBps=copy_gbps)


if __name__ == "__main__":
    main()
