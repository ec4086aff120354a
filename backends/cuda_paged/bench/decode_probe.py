"""cuda_paged decode launches of one shape, checked then timed, for Nsight Compute and A/B runs.

    python3 backends/cuda_paged/bench/decode_probe.py [--shape 64x4096] [--kv auto,fp8] \
        [--heads 32/8] [--head-size 128] [--json OUT.json] [--iters 50]

Per KV-cache dtype: the bench's cache (`pagedcore.bench.kernel_primitives.PagedKV`: by default
32 query / 8 KV heads, head size 128 (``--heads 14/2 --head-size 64``: the Qwen2-0.5B shape),
block size 16, blocks in random order, bf16 K/V; fp8 caches written
by the backend's own cache write with per-tensor scales from the data), one decode launch
checked against SDPA on the contiguous K/V (relative error printed), then ``--iters`` timed
launches (CUDA events, median of the per-launch times, each behind a ~1 ms GPU spin so that
the host's launch cost is not timed; L2 not flushed: the cache is far larger than L2). Under
``ncu --kernel-name regex:decode`` the first launches of each dtype are the
checked one and the first timed ones. ``PAGEDCORE_CUDA_PAGED_FP8_DECODE`` (read by the
extension) picks the fp8 decode kernel, so two processes compare them. (Other backends at
the same shape, side by side: ``pagedcore bench kernels --case decode --heads ... --head-size
... --decode-shapes ...``.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics


def main() -> None:
    import torch
    from pagedcore_cuda_paged import CudaPagedBackend

    from pagedcore.bench.kernel_primitives import BackendUnderTest, PagedKV, rel_error

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="64x4096")
    parser.add_argument("--kv", default="auto,fp8")
    parser.add_argument("--heads", default="32/8", help="query / KV heads")
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    batch, ctx = (int(x) for x in args.shape.split("x"))
    hq, hkv = (int(x) for x in args.heads.split("/"))
    d = args.head_size
    dev = torch.device("cuda")
    torch.manual_seed(0)
    kv = PagedKV([ctx] * batch, torch.bfloat16, dev, num_kv_heads=hkv, head_size=d)
    query = torch.randn((batch, hq, d), dtype=torch.bfloat16, device=dev)
    k4 = kv.key.view(batch, ctx, hkv, d).transpose(1, 2)
    v4 = kv.value.view(batch, ctx, hkv, d).transpose(1, 2)
    ref = torch.nn.functional.scaled_dot_product_attention(
        query.view(batch, 1, hq, d).transpose(1, 2), k4, v4, enable_gqa=True
    ).transpose(1, 2).reshape(query.shape)
    rows = []
    for kv_dtype in args.kv.split(","):
        under = BackendUnderTest(CudaPagedBackend, kv, kv_cache_dtype=kv_dtype, num_heads=hq)
        run = under.runner(kv, [1] * batch, list(range(batch)), query)
        err = rel_error(run(), ref)
        start = [torch.cuda.Event(enable_timing=True) for _ in range(args.iters)]
        end = [torch.cuda.Event(enable_timing=True) for _ in range(args.iters)]
        for i in range(args.iters):
            torch.cuda._sleep(2_000_000)  # ~1 ms: the host queues the launch meanwhile
            start[i].record()
            run()
            end[i].record()
        torch.cuda.synchronize()
        ms = statistics.median(s.elapsed_time(e) for s, e in zip(start, end, strict=True))
        nbytes = 2 * batch * ctx * hkv * d * under.kv_cache.dtype.itemsize
        row = {"shape": args.shape, "heads": args.heads, "head_size": d,
               "kv_cache_dtype": kv_dtype, "ms": ms, "rel_err": err,
               "GBps": nbytes / ms / 1e6,
               "fp8_kernel": os.environ.get("PAGEDCORE_CUDA_PAGED_FP8_DECODE", "default")}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del under
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": rows, "device": torch.cuda.get_device_name(),
                       "commit": os.environ.get("PAGEDCORE_GIT_COMMIT")}, fh, indent=1)


if __name__ == "__main__":
    main()
