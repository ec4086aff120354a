"""Timings of the cuda_paged kernels on one GPU; prints tables and writes JSON.

bf16, 32 query heads / 8 KV heads, head size 128, block size 16 (the Triton issue's shapes):
device copy bandwidth; decode at 64x4096, 8x32768, 256x1024 (every kernel variant: MMA one
pass / partitions / unroll, CLASSIC grouped) against contiguous SDPA; the MMA one-pass /
partitioned crossover grid; causal prefill 4x2048 and 4x8192 and a 2048-token chunk over a
6144-token prefix (MMA and WMMA kernels) against contiguous SDPA; a mixed step (64 decodes +
one 2048-token chunk).

    python backends/cuda_paged/bench/bench_kernels.py --json OUT.json [--commit SHA]
        [--sections decode,prefill,mixed,crossover] [--kernels mma_128_fast,...]
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from pagedcore_cuda_paged import CudaPagedBackend
from pagedcore_cuda_paged.plan import DecodeKernel, DecodePass, DecodePolicy, PrefillKernel

from pagedcore.attention.metadata import CommonAttentionMetadata
from pagedcore.bench import kernel_primitives
from pagedcore.kv_cache.spec import FullAttentionSpec

HQ, HKV, D, B = 32, 8, 128, 16
DT = torch.bfloat16
DEV = torch.device("cuda")


def time_ms(fn: Callable[[], Any], iters: int = 20) -> float:
    """Device ms per call, timed like `pagedcore bench kernels` (back-to-back calls after an
    L2 flush and a GPU spin, so no host time is counted); `iters` bounds the budget."""
    return kernel_primitives.time_ms(fn, DEV, budget_ms=20.0 * iters)


def copy_gbps() -> float:
    x = torch.empty(1 << 30, dtype=torch.float16, device=DEV)
    y = torch.empty_like(x)
    ms = time_ms(lambda: y.copy_(x))
    return 2 * x.numel() * 2 / ms / 1e6


class Paged:
    """A batch of (context, new tokens) requests in a randomly permuted paged cache."""

    def __init__(self, reqs: list[tuple[int, int]]) -> None:
        self.reqs = reqs
        seq = [c + q for c, q in reqs]
        counts = [math.ceil(s / B) for s in seq]
        self.num_blocks = 1 + sum(counts)
        perm = (torch.randperm(self.num_blocks - 1) + 1).tolist()
        self.table = torch.zeros(len(reqs), max(counts), dtype=torch.int32)
        pos = 0
        for r, n in enumerate(counts):
            self.table[r, :n] = torch.tensor(perm[pos:pos + n], dtype=torch.int32)
            pos += n
        self.k = [torch.randn(s, HKV, D, dtype=DT, device=DEV) for s in seq]
        self.v = [torch.randn(s, HKV, D, dtype=DT, device=DEV) for s in seq]
        self.q = torch.randn(sum(q for _, q in reqs), HQ, D, dtype=DT, device=DEV)
        self.impl = CudaPagedBackend.get_impl_cls()(HQ, D, D**-0.5, num_kv_heads=HKV)
        shape = CudaPagedBackend.get_kv_cache_shape(self.num_blocks, B, HKV, D)
        self.cache = torch.empty(shape, dtype=DT, device=DEV)
        tab = self.table.to(DEV).long()
        for r, s in enumerate(seq):
            p = torch.arange(s, device=DEV)
            slots = tab[r, p // B] * B + p % B
            self.impl.do_kv_cache_update(self.k[r], self.v[r], self.cache, slots)
        qsl = [0]
        for _, q in reqs:
            qsl.append(qsl[-1] + q)
        qsl_t, seq_t = torch.tensor(qsl, dtype=torch.int32), torch.tensor(seq, dtype=torch.int32)
        self.common = CommonAttentionMetadata(
            query_start_loc=qsl_t.to(DEV), query_start_loc_cpu=qsl_t, seq_lens=seq_t.to(DEV),
            seq_lens_cpu=seq_t, num_reqs=len(reqs), num_actual_tokens=qsl[-1],
            max_query_len=max(q for _, q in reqs), max_seq_len=max(seq),
            block_table=self.table.to(DEV),
            slot_mapping=torch.full((qsl[-1],), -1, dtype=torch.int64, device=DEV),
            positions=torch.zeros(qsl[-1], dtype=torch.int64, device=DEV))
        self.spec = FullAttentionSpec(block_size=B, num_kv_heads=HKV, head_size=D, dtype=DT)

    def runner(self, policy: DecodePolicy | None = None,
               prefill: PrefillKernel = PrefillKernel.MMA) -> Callable[[], torch.Tensor]:
        builder = CudaPagedBackend.get_builder_cls()(self.spec, ["b"], DEV, policy=policy,
                                                     prefill_kernel=prefill)
        md = builder.build(self.common)
        out = torch.empty_like(self.q)
        kv = self.q[:, :HKV]
        return lambda: self.impl.forward(self.q, kv, kv, self.cache, md, output=out)

    def kv_bytes(self) -> int:
        return sum(k.numel() * 2 * k.element_size() for k in self.k)


def sdpa_uniform(batch: int, q_len: int, ctx: int, causal: bool,
                 paged: Paged) -> tuple[Callable[[], torch.Tensor], torch.Tensor]:
    q = paged.q.view(batch, q_len, HQ, D).transpose(1, 2).contiguous()
    k = torch.stack(paged.k).transpose(1, 2).contiguous()
    v = torch.stack(paged.v).transpose(1, 2).contiguous()

    def fn() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

    ref = fn().transpose(1, 2).reshape(batch * q_len, HQ, D)
    return fn, ref


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max())


DECODE_SHAPES = [(64, 4096), (8, 32768), (256, 1024)]  # (batch, context)
PREFILL_SHAPES = [(4, 0, 2048), (4, 0, 8192), (4, 6144, 2048)]  # (batch, prefix, chunk)
PREFILL_KERNELS = [PrefillKernel.MMA_128_FAST, PrefillKernel.MMA_128_FAST_HM,
                   PrefillKernel.MMA_128_FAST_WM, PrefillKernel.MMA_128_FAST_HM_WM,
                   PrefillKernel.MMA_128_FAST_WM_1B, PrefillKernel.MMA_128_FAST_WMP,
                   PrefillKernel.MMA_128_FAST_WMP_1B,
                   PrefillKernel.MMA_128_K32_3STAGE_FAST_HM,
                   PrefillKernel.MMA_64_K32_3STAGE_FAST_HM,
                   PrefillKernel.MMA_128_K32_4STAGE_FAST_HM,
                   PrefillKernel.MMA_128_K32_3STAGE_FAST,
                   PrefillKernel.MMA_128_K32_3STAGE, PrefillKernel.MMA_128_K32_PIPE,
                   PrefillKernel.MMA_W8_3STAGE, PrefillKernel.MMA_128_PIPE,
                   PrefillKernel.MMA_W8_PIPE, PrefillKernel.MMA_256_K32_PIPE,
                   PrefillKernel.MMA_PIPE, PrefillKernel.MMA_128]
CROSS_CTX, CROSS_BATCH = [1024, 4096, 16384, 32768], [1, 4, 16, 64, 128, 256]
ONE, PART = DecodePass.ONE_PASS, DecodePass.PARTITIONED
CLASSIC = DecodeKernel.CLASSIC
DECODE_VARIANTS: list[tuple[str, DecodePolicy | None]] = [
    ("mma_one_pass_u1", DecodePolicy(force=ONE, unroll=1)),
    ("mma_one_pass_u2", DecodePolicy(force=ONE, unroll=2)),
    ("mma_part512", DecodePolicy(force=PART, partition_size=512, unroll=1)),
    ("mma_part1024", DecodePolicy(force=PART, partition_size=1024, unroll=1)),
    ("mma_part2048", DecodePolicy(force=PART, partition_size=2048, unroll=1)),
    ("mma_part1024_u2", DecodePolicy(force=PART, partition_size=1024, unroll=2)),
    ("mma_ring_one_pass", DecodePolicy(force=ONE, unroll=3)),
    ("mma_ring_part1024", DecodePolicy(force=PART, partition_size=1024, unroll=3)),
    ("mma_ring_part2048", DecodePolicy(force=PART, partition_size=2048, unroll=3)),
    ("classic_grouped_one_pass", DecodePolicy(force=ONE, kernel=CLASSIC)),
    ("classic_grouped_part1024", DecodePolicy(force=PART, partition_size=1024,
                                              kernel=CLASSIC)),
    ("auto", None),  # the shipped planner; timed last (the first timing of a shape runs cold)
]


def bench_decode(copy: float) -> list[dict[str, Any]]:
    rows = []
    for batch, ctx in DECODE_SHAPES:
        paged = Paged([(ctx - 1, 1)] * batch)
        sdpa_fn, ref = sdpa_uniform(batch, 1, ctx, False, paged)
        sdpa_ms = time_ms(sdpa_fn)
        gb = paged.kv_bytes() / 1e9
        time_ms(paged.runner())  # discarded: the first timing after a new cache runs cold
        for label, policy in DECODE_VARIANTS:
            try:
                fn = paged.runner(policy)
                ms = time_ms(fn)
            except Exception as exc:  # report and continue
                rows.append(dict(case="decode", batch=batch, ctx=ctx,
                                 impl=f"cuda_paged/{label}", error=repr(exc)))
                continue
            bw = gb / ms * 1e3
            rows.append(dict(case="decode", batch=batch, ctx=ctx, impl=f"cuda_paged/{label}",
                             ms=ms, gbps=bw, frac_copy=bw / copy, vs_sdpa=sdpa_ms / ms,
                             rel_err=rel(fn(), ref)))
        rows.append(dict(case="decode", batch=batch, ctx=ctx, impl="sdpa_contiguous",
                         ms=sdpa_ms, gbps=gb / sdpa_ms * 1e3, frac_copy=gb / sdpa_ms * 1e3 / copy))
        del paged
        torch.cuda.empty_cache()
    return rows


def bench_crossover() -> list[dict[str, Any]]:
    """MMA kernel: one pass against partition sizes, over batch x context."""
    rows = []
    for ctx in CROSS_CTX:
        for batch in CROSS_BATCH:
            if batch * ctx > (1 << 21):
                continue
            paged = Paged([(ctx - 1, 1)] * batch)
            row: dict[str, Any] = dict(batch=batch, ctx=ctx, mma_blocks=batch * HKV)
            row["one_pass_ms"] = time_ms(paged.runner(DecodePolicy(force=ONE, unroll=1)),
                                         iters=5)
            for part in (256, 512, 1024, 2048):
                if part < ctx:
                    row[f"part{part}_ms"] = time_ms(paged.runner(
                        DecodePolicy(partition_size=part, force=PART, unroll=1)), iters=5)
            row["auto_ms"] = time_ms(paged.runner(), iters=5)
            rows.append(row)
            del paged
    torch.cuda.empty_cache()
    return rows


def bench_prefill(kernels: list[PrefillKernel] | None = None) -> list[dict[str, Any]]:
    rows = []
    for batch, ctx, length in PREFILL_SHAPES:
        paged = Paged([(ctx, length)] * batch)
        if ctx == 0:
            sdpa_fn, ref = sdpa_uniform(batch, length, length, True, paged)
        else:  # a chunk over a prefix: SDPA with an explicit bottom-right causal mask
            q = paged.q.view(batch, length, HQ, D).transpose(1, 2).contiguous()
            k = torch.stack(paged.k).transpose(1, 2).contiguous()
            v = torch.stack(paged.v).transpose(1, 2).contiguous()
            mask = torch.ones(length, ctx + length, dtype=torch.bool, device=DEV).tril(ctx)

            def sdpa_fn(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v,
                        mask: torch.Tensor = mask) -> torch.Tensor:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                      enable_gqa=True)

            ref = sdpa_fn().transpose(1, 2).reshape(batch * length, HQ, D)
        # Causal FLOPs: 4 * D per visible (query, key) pair.
        pairs = batch * (length * ctx + length * (length + 1) // 2)
        flops = 4 * HQ * D * pairs
        sdpa_ms = time_ms(sdpa_fn, iters=5)
        shape = f"{batch}x{length}" + (f"+{ctx}cached" if ctx else "")
        for kern in kernels or PREFILL_KERNELS:
            try:
                fn = paged.runner(prefill=kern)
                ms = time_ms(fn, iters=5)
            except Exception as exc:  # report and continue
                rows.append(dict(case="prefill", impl=f"cuda_paged/{kern.value}", batch=batch,
                                 prefix=ctx, len=length, shape=shape, error=repr(exc)))
                continue
            rows.append(dict(case="prefill", impl=f"cuda_paged/{kern.value}", batch=batch,
                             prefix=ctx, len=length, shape=shape, ms=ms, tflops=flops / ms / 1e9,
                             sdpa_ms=sdpa_ms, sdpa_tflops=flops / sdpa_ms / 1e9,
                             vs_sdpa=sdpa_ms / ms, rel_err=rel(fn(), ref)))
        del paged
        torch.cuda.empty_cache()
    return rows


def bench_mixed() -> dict[str, Any]:
    decodes = [(4095, 1)] * 64
    mixed = Paged([*decodes, (0, 2048)])
    dec, pre = Paged(decodes), Paged([(0, 2048)])
    both = time_ms(mixed.runner())
    fd, fp = dec.runner(), pre.runner()
    separate = time_ms(lambda: (fd(), fp()))
    return dict(case="mixed", decodes=64, ctx=4096, chunk=2048, ms=both, separate_ms=separate)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--skip-crossover", action="store_true")
    ap.add_argument("--sections", default="decode,prefill,mixed,crossover")
    ap.add_argument("--kernels", help="comma-separated PrefillKernel values to time (default: "
                    "PREFILL_KERNELS)")
    args = ap.parse_args()
    kernels = [PrefillKernel(v) for v in args.kernels.split(",")] if args.kernels else None
    torch.manual_seed(0)
    result: dict[str, Any] = dict(
        device=torch.cuda.get_device_name(), torch=torch.__version__, commit=args.commit,
        command="python backends/cuda_paged/bench/bench_kernels.py --json PATH",
        shapes=dict(num_heads=HQ, num_kv_heads=HKV, head_size=D, block_size=B,
                    dtype="bfloat16"))

    def save(key: str, value: Any) -> None:
        result[key] = value
        for r in value if isinstance(value, list) else [value]:
            print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                            for k, v in r.items()), flush=True)
        if args.json:  # after every section, so a timeout keeps what was measured
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)

    copy = copy_gbps()
    save("copy", {"copy_gbps": copy})
    sections = args.sections.split(",")
    if "decode" in sections:
        save("decode", bench_decode(copy))
    if "prefill" in sections:
        save("prefill", bench_prefill(kernels))
    if "mixed" in sections:
        save("mixed", bench_mixed())
    if "crossover" in sections and not args.skip_crossover:
        save("crossover", bench_crossover())


if __name__ == "__main__":
    main()
