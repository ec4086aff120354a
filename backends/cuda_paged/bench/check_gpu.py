"""GPU correctness sweep of cuda_paged against `attention_reference` (run on the H200).

Drives the backend exactly as an engine does (NaN-filled cache, permuted physical blocks with
block 0 never used, history written first, -1 padding slots, then one mixed step) across
dtypes, head sizes, block sizes, GQA ratios, window / ALiBi / soft-cap, both decode passes and
every kernel variant (decode MMA unroll 1 / 2 / 3 and CLASSIC grouped / per head; prefill
MMA 64 / 128 rows, the pipelined-gather variants (`PIPES`), WMMA, WMMA lane-per-key),
including long chunked prefills over a cached prefix (several key tiles, the causal diagonal
inside a tile). Prints one line per case and exits non-zero on any failure; ``--json`` also
writes every case's error.

    python backends/cuda_paged/bench/check_gpu.py [--quick] [--json P]
        [--only mma|classic|new|old_mma]   (new: pipelined prefills and ring decode only)
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys

import torch
from pagedcore_cuda_paged import CudaPagedBackend
from pagedcore_cuda_paged.plan import (
    DEFAULT_PREFILL_KERNEL,
    DecodeKernel,
    DecodePass,
    DecodePolicy,
    PrefillKernel,
)
from pagedcore_cuda_paged.torch_ref import attention_reference

from pagedcore.attention.metadata import CommonAttentionMetadata
from pagedcore.kv_cache.spec import FullAttentionSpec

TOL = {torch.float32: 1e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2}
# (context, new tokens): decodes at block edges and mid-block, prefills, chunked prefills.
REQUESTS = [(16, 1), (5, 1), (0, 1), (300, 1), (47, 1), (0, 70), (33, 16), (10, 130), (64, 2)]
# Long chunks over a cached prefix: many 64-key tiles, diagonals inside tiles, odd lengths.
LONG = [(300, 200), (0, 257), (129, 64), (1000, 1), (700, 1), (61, 3)]


def slopes(n: int) -> list[float]:
    return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]


def run_case(dtype: torch.dtype, head: int, block: int, hkv: int, group: int, *,
             window: int | None, alibi: bool, cap: float | None, force: DecodePass | None,
             seed: int, device: str = "cuda", reqs: list[tuple[int, int]] | None = None,
             partition_size: int = 64, group_heads: bool = True,
             prefill: PrefillKernel = DEFAULT_PREFILL_KERNEL,
             kernel: DecodeKernel = DecodeKernel.MMA, unroll: int | None = 1) -> float:
    """Max relative error of one mixed step against the reference (NaN if NaN leaked)."""
    gen = torch.Generator().manual_seed(seed)
    dev = torch.device(device)
    hq = hkv * group
    reqs = REQUESTS if reqs is None else reqs
    counts = [math.ceil((c + q) / block) for c, q in reqs]
    num_blocks = 1 + sum(counts) + 3
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    ids, it = [], iter(perm)
    for n in counts:
        ids.append([next(it) for _ in range(n)])
    keys = [torch.randn(c + q, hkv, head, generator=gen).to(dtype) for c, q in reqs]
    vals = [torch.randn(c + q, hkv, head, generator=gen).to(dtype) for c, q in reqs]
    qs = [torch.randn(q, hq, head, generator=gen).to(dtype) for _, q in reqs]

    def slots(r: int, a: int, b: int) -> list[int]:
        return [ids[r][p // block] * block + p % block for p in range(a, b)]

    impl = CudaPagedBackend.get_impl_cls()(
        hq, head, head**-0.5, num_kv_heads=hkv, alibi_slopes=slopes(hq) if alibi else None,
        sliding_window=window, logits_soft_cap=cap)
    shape = CudaPagedBackend.get_kv_cache_shape(num_blocks, block, hkv, head, "auto")
    cache = torch.full(shape, float("nan"), dtype=dtype, device=dev)
    hist = [(r, c) for r, (c, _) in enumerate(reqs) if c]
    impl.do_kv_cache_update(
        torch.cat([keys[r][:c] for r, c in hist]).to(dev),
        torch.cat([vals[r][:c] for r, c in hist]).to(dev), cache,
        torch.tensor([s for r, c in hist for s in slots(r, 0, c)], device=dev))
    pad = 2
    nan = torch.full((pad, hkv, head), float("nan"), dtype=dtype)
    key = torch.cat([*(k[c:] for k, (c, _) in zip(keys, reqs, strict=True)), nan]).to(dev)
    val = torch.cat([*(v[c:] for v, (c, _) in zip(vals, reqs, strict=True)), nan]).to(dev)
    query = torch.cat([*qs, torch.full((pad, hq, head), float("nan"), dtype=dtype)]).to(dev)
    slot = [s for r, (c, q) in enumerate(reqs) for s in slots(r, c, c + q)] + [-1] * pad
    slot_t = torch.tensor(slot, dtype=torch.int64, device=dev)
    impl.do_kv_cache_update(key, val, cache, slot_t)
    qsl = [0]
    for _, q in reqs:
        qsl.append(qsl[-1] + q)
    seq = [c + q for c, q in reqs]
    table = torch.zeros(len(reqs), max(counts) + 1, dtype=torch.int32)
    for r, row in enumerate(ids):
        table[r, : len(row)] = torch.tensor(row, dtype=torch.int32)
    qsl_t, seq_t = torch.tensor(qsl, dtype=torch.int32), torch.tensor(seq, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl_t.to(dev), query_start_loc_cpu=qsl_t, seq_lens=seq_t.to(dev),
        seq_lens_cpu=seq_t, num_reqs=len(reqs), num_actual_tokens=qsl[-1],
        max_query_len=max(q for _, q in reqs), max_seq_len=max(seq),
        block_table=table.to(dev), slot_mapping=slot_t,
        positions=torch.zeros(len(slot), dtype=torch.int64, device=dev))
    spec = FullAttentionSpec(block_size=block, num_kv_heads=hkv, head_size=head, dtype=dtype)
    policy = DecodePolicy(partition_size=partition_size, force=force, group_heads=group_heads,
                          kernel=kernel, unroll=unroll)
    builder = CudaPagedBackend.get_builder_cls()(spec, ["l"], dev, policy=policy,
                                                 prefill_kernel=prefill)
    out = impl.forward(query, key, val, cache, builder.build(common))
    ref = torch.cat([
        attention_reference(qs[r].to(dev), keys[r].to(dev), vals[r].to(dev), scale=head**-0.5,
                            sliding_window=window, alibi_slopes=slopes(hq) if alibi else None,
                            logits_soft_cap=cap)
        for r in range(len(reqs))])
    got = out[: qsl[-1]].float()
    if torch.isnan(got).any():
        return float("nan")
    return float((got - ref).abs().max() / ref.abs().max())


def run_graph_case(dtype: torch.dtype, head: int, block: int, *, window: int | None,
                   kernel: DecodeKernel = DecodeKernel.MMA, seed: int = 0,
                   device: str = "cuda", max_seq_len: int = 700) -> float:
    """Uniform decode planned by `build_for_cudagraph_capture`, captured in a CUDA graph (on
    CUDA), then replayed after rewriting seq_lens, block table and queries in place (longer
    and shorter than at capture, one padding row); max relative error of the real rows."""
    gen = torch.Generator().manual_seed(seed)
    dev = torch.device(device)
    hkv, group, n = 2, 4, 6
    hq = hkv * group
    max_blocks = math.ceil(max_seq_len / block)
    num_blocks = 1 + n * max_blocks
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).view(n, max_blocks)
    keys = torch.randn(n, max_seq_len, hkv, head, generator=gen).to(dtype)
    vals = torch.randn(n, max_seq_len, hkv, head, generator=gen).to(dtype)
    impl = CudaPagedBackend.get_impl_cls()(hq, head, head**-0.5, num_kv_heads=hkv,
                                           sliding_window=window)
    shape = CudaPagedBackend.get_kv_cache_shape(num_blocks, block, hkv, head, "auto")
    cache = torch.full(shape, float("nan"), dtype=dtype, device=dev)
    pos = torch.arange(max_seq_len)
    slots = (perm[:, pos // block] * block + pos % block).reshape(-1)
    impl.do_kv_cache_update(keys.reshape(-1, hkv, head).to(dev),
                            vals.reshape(-1, hkv, head).to(dev), cache, slots.to(dev))
    table = torch.zeros(n, max_blocks, dtype=torch.int32, device=dev)
    seq = torch.ones(n, dtype=torch.int32, device=dev)
    qsl = torch.arange(n + 1, dtype=torch.int32)
    query = torch.zeros(n, hq, head, dtype=dtype, device=dev)
    out = torch.zeros_like(query)

    def fill(lens: list[int]) -> list[torch.Tensor]:
        qs = [torch.randn(hq, head, generator=gen).to(dtype) for _ in lens]
        for r, s in enumerate(lens):
            seq[r] = s
            table[r] = perm[r].to(torch.int32) if s > 1 else 0
            query[r] = qs[r]
        return qs

    common = CommonAttentionMetadata(
        query_start_loc=qsl.to(dev), query_start_loc_cpu=qsl, seq_lens=seq,
        seq_lens_cpu=torch.ones(n, dtype=torch.int32), num_reqs=n, num_actual_tokens=n,
        max_query_len=1, max_seq_len=max_seq_len, block_table=table,
        slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=dev),
        positions=torch.zeros(n, dtype=torch.int64, device=dev))
    spec = FullAttentionSpec(block_size=block, num_kv_heads=hkv, head_size=head, dtype=dtype)
    builder = CudaPagedBackend.get_builder_cls()(
        spec, ["l"], dev, policy=DecodePolicy(kernel=kernel, partition_size=128))
    meta = builder.build_for_cudagraph_capture(common)
    fill([3, 40, 1, 300, 7, 1])
    step = lambda: impl.forward(query, query[:, :hkv], query[:, :hkv], cache, meta,  # noqa: E731
                                output=out)
    if dev.type == "cuda":
        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        step = graph.replay
    worst = 0.0
    for lens in ([max_seq_len, 129, 1, 16, max_seq_len - 5, 2], [5, 600, 33, 1, 97, 250]):
        qs = fill(lens)
        step()
        for r, s in enumerate(lens):
            if s == 1:
                continue  # a padding row: discarded
            ref = attention_reference(qs[r][None].to(dev), keys[r, :s].to(dev),
                                      vals[r, :s].to(dev), scale=head**-0.5,
                                      sliding_window=window)[0]
            got = out[r].float()
            if torch.isnan(got).any():
                return float("nan")
            worst = max(worst, float((got - ref).abs().max() / ref.abs().max()))
    return worst


#: The pipelined-gather prefill kernels (the candidates for the default).
PIPES = [PrefillKernel.MMA_128_PIPE, PrefillKernel.MMA_PIPE, PrefillKernel.MMA_W8_PIPE,
         PrefillKernel.MMA_128_K32_PIPE, PrefillKernel.MMA_256_K32_PIPE,
         PrefillKernel.MMA_128_K32_3STAGE, PrefillKernel.MMA_W8_3STAGE,
         PrefillKernel.MMA_128_K32_3STAGE_FAST, PrefillKernel.MMA_128_FAST,
         PrefillKernel.MMA_128_K32_3STAGE_FAST_HM, PrefillKernel.MMA_64_K32_3STAGE_FAST_HM,
         PrefillKernel.MMA_128_K32_4STAGE_FAST_HM,
         PrefillKernel.MMA_128_FAST_HM, PrefillKernel.MMA_128_FAST_WM,
         PrefillKernel.MMA_128_FAST_HM_WM, PrefillKernel.MMA_128_FAST_WM_1B,
         PrefillKernel.MMA_128_FAST_WMP, PrefillKernel.MMA_128_FAST_WMP_1B]
#: The multi-stage ones among `PIPES` (from MMA_128_K32_3STAGE on).
STAGED = PIPES[PIPES.index(PrefillKernel.MMA_128_K32_3STAGE):]
# Long prompts: several 128/256-row tiles, a chunk over a long prefix, block-table lookahead.
LONGER = [(0, 600), (1500, 700), (37, 300), (2000, 1)]


def cases() -> list[dict[str, object]]:
    """Every case of the sweep; keys are `run_case`'s arguments."""
    dtypes = [torch.float16, torch.bfloat16, torch.float32]
    half = [torch.float16, torch.bfloat16]
    heads = [64, 80, 96, 112, 128, 256]
    base = dict(hkv=2, group=4, window=None, alibi=False, cap=None, force=None)
    out: list[dict[str, object]] = []
    # Shipped defaults (MMA decode + prefill where they apply) on every dtype/head/block.
    for dtype, head, block in itertools.product(dtypes, heads, [8, 16, 32]):
        out.append({**base, "dtype": dtype, "head": head, "block": block})
    # Pipelined-gather prefill on every half dtype / head / block size.
    for dtype, head, block, pre in itertools.product(
            half, [64, 80, 96, 112, 128], [8, 16, 32], PIPES):
        out.append({**base, "dtype": dtype, "head": head, "block": block, "prefill": pre,
                    "reqs": LONG, "window": 70 if block == 8 else None, "partition_size": 256})
    # Longer prompts and chunks through the pipelined kernels (GQA 4 and 1, causal tiles).
    for dtype, head, block, pre in itertools.product(half, [64, 128], [16, 32], PIPES):
        out.append({**base, "dtype": dtype, "head": head, "block": block, "prefill": pre,
                    "reqs": LONGER, "group": 1 if block == 32 else 4, "partition_size": 512})
    # GQA 7 and 8 (query heads of one KV head in consecutive thread blocks: head-major order)
    # through the pipelined kernels, every block size, with a window or a soft-cap.
    for dtype, group, block, pre in itertools.product(half, [7, 8], [8, 16, 32], PIPES):
        out.append({**base, "dtype": dtype, "head": 128, "block": block, "prefill": pre,
                    "reqs": LONGER, "group": group, "hkv": 1 if block == 8 else 2,
                    "window": 333 if block == 16 else None, "cap": 5.0 if block == 32 else None,
                    "partition_size": 512})
    # Long chunked prefills over cached prefixes (MMA and WMMA prefill), all head sizes.
    for dtype, head, (window, alibi, cap), pre in itertools.product(
            half, [64, 80, 96, 112, 128], [(None, False, None), (100, True, None),
                                           (None, False, 5.0)],
            [PrefillKernel.MMA, PrefillKernel.MMA_128, PrefillKernel.WMMA, *PIPES]):
        out.append({**base, "dtype": dtype, "head": head, "block": 16, "window": window,
                    "alibi": alibi, "cap": cap, "prefill": pre, "reqs": LONG,
                    "partition_size": 256})
    for dtype, block, unroll in itertools.product(half, [8, 16, 32], [1, 2, 3]):
        out.append({**base, "dtype": dtype, "head": 96, "block": block, "reqs": LONG,
                    "window": 77, "partition_size": 128, "unroll": unroll,
                    "force": DecodePass.PARTITIONED})
    # MMA decode: GQA ratios (16: all 16 rows; 24: two head chunks), both passes, unroll.
    for dtype, group, force, unroll in itertools.product(
            half, [1, 4, 7, 8, 16, 24], [DecodePass.ONE_PASS, DecodePass.PARTITIONED],
            [1, 2, 3]):
        out.append({**base, "dtype": dtype, "head": 128, "block": 16, "group": group,
                    "hkv": 1 if group > 8 else 2, "force": force, "unroll": unroll})
    # The cp.async-ring decode (unroll 3) on every half dtype / head / block size.
    for dtype, head, block in itertools.product(half, [64, 80, 96, 112, 128], [8, 16, 32]):
        out.append({**base, "dtype": dtype, "head": head, "block": block, "unroll": 3,
                    "window": 37 if block == 16 else None, "alibi": block == 32})
    # Window / ALiBi / soft-cap through every kernel family.
    feats = [(37, False, None), (8, False, None), (None, True, None), (None, False, 5.0),
             (50, True, 5.0)]
    for dtype, (window, alibi, cap), force, (kern, grouped, pre) in itertools.product(
            dtypes, feats, [DecodePass.ONE_PASS, DecodePass.PARTITIONED],
            [(DecodeKernel.MMA, True, PrefillKernel.MMA),
             (DecodeKernel.CLASSIC, True, PrefillKernel.WMMA),
             (DecodeKernel.CLASSIC, False, PrefillKernel.WMMA)]):
        if dtype == torch.float32 and kern is DecodeKernel.MMA:
            continue  # falls back to CLASSIC: covered by the other rows
        for block in (8, 32):
            out.append({**base, "dtype": dtype, "head": 64, "block": block, "window": window,
                        "alibi": alibi, "cap": cap, "force": force, "kernel": kern,
                        "group_heads": grouped, "prefill": pre})
    # CLASSIC decode (grouped and per head), both passes, GQA ratios.
    for dtype, group, force, grouped in itertools.product(
            dtypes, [1, 4, 7, 8], [DecodePass.ONE_PASS, DecodePass.PARTITIONED], [True, False]):
        out.append({**base, "dtype": dtype, "head": 128, "block": 16, "group": group,
                    "force": force, "group_heads": grouped, "kernel": DecodeKernel.CLASSIC,
                    "prefill": PrefillKernel.WMMA})
    for dtype, head in itertools.product(dtypes, [80, 256]):  # grouped, group 16 (two sweeps)
        out.append({**base, "dtype": dtype, "head": head, "block": 16, "hkv": 1, "group": 16,
                    "alibi": True, "force": DecodePass.PARTITIONED,
                    "kernel": DecodeKernel.CLASSIC})
    for dtype, head, (window, alibi, cap) in itertools.product(
            dtypes, [64, 128, 256], [(None, False, None), (37, True, 5.0)]):
        out.append({**base, "dtype": dtype, "head": head, "block": 16, "window": window,
                    "alibi": alibi, "cap": cap, "prefill": PrefillKernel.WMMA_LANE_PER_KEY})
    return out


def _is_new(c: dict[str, object]) -> bool:
    """Cases of the newer kernels: pipelined prefills (incl. the default), the ring decode."""
    return c.get("prefill") in PIPES or c.get("unroll") == 3


def _uses_mma(c: dict[str, object]) -> bool:
    prefill = c.get("prefill", DEFAULT_PREFILL_KERNEL)
    return c.get("kernel", DecodeKernel.MMA) is DecodeKernel.MMA or prefill not in (
        PrefillKernel.WMMA, PrefillKernel.WMMA_LANE_PER_KEY)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=["mma", "classic", "new", "old_mma"])
    ap.add_argument("--json")
    ap.add_argument("--graphs", action="store_true", help="only the CUDA-graph replay cases")
    ap.add_argument("--prefill", help="comma-separated PrefillKernel values: only the cases "
                    "that name one of them")
    args = ap.parse_args()
    if args.graphs:
        return graph_main()
    todo = cases()
    if args.only == "mma":
        todo = [c for c in todo if _uses_mma(c)]
    elif args.only == "new":
        todo = [c for c in todo if _is_new(c)]
    elif args.only == "old_mma":
        todo = [c for c in todo if _uses_mma(c) and not _is_new(c)]
    elif args.only == "classic":
        todo = [c for c in todo if not _uses_mma(c)]
    if args.prefill:
        keep = {PrefillKernel(v) for v in args.prefill.split(",")}
        todo = [c for c in todo if c.get("prefill") in keep]
    if args.quick:
        todo = todo[::7]
    failures = 0
    results = []
    for i, c in enumerate(todo):
        try:
            err = run_case(seed=i, **c)  # type: ignore[arg-type]
            ok = err <= TOL[c["dtype"]]  # type: ignore[index]  # NaN compares False
            msg = f"rel_err={err:.2e}"
        except Exception as exc:  # report and continue
            err, ok, msg = float("nan"), False, f"{type(exc).__name__}: {exc}"
        failures += not ok
        desc = " ".join(f"{k}={str(v).removeprefix('torch.')}" for k, v in c.items()
                        if k != "reqs") + (" reqs=LONG" if "reqs" in c else "")
        print(f"{'PASS' if ok else 'FAIL'} {desc} {msg}", flush=True)
        results.append(dict(case=desc, ok=ok, rel_err=err, msg=msg))
    torch.cuda.synchronize()
    print(f"{len(todo) - failures}/{len(todo)} passed")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(passed=len(todo) - failures, total=len(todo), cases=results), f,
                      indent=1)
    return 1 if failures else 0


def graph_main() -> int:
    failures = 0
    for dtype, head, block, window, kernel in [
            (torch.bfloat16, 128, 16, None, DecodeKernel.MMA),
            (torch.float16, 64, 8, 100, DecodeKernel.MMA),
            (torch.bfloat16, 128, 32, None, DecodeKernel.CLASSIC),
            (torch.float32, 256, 16, 50, DecodeKernel.MMA)]:  # fp32 / 256: CLASSIC
        try:
            err = run_graph_case(dtype, head, block, window=window, kernel=kernel)
            ok, msg = err <= TOL[dtype], f"rel_err={err:.2e}"
        except Exception as exc:  # report and continue
            ok, msg = False, f"{type(exc).__name__}: {exc}"
        failures += not ok
        print(f"{'PASS' if ok else 'FAIL'} graph dtype={dtype} head={head} block={block} "
              f"window={window} kernel={kernel.value} {msg}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
