"""GPU correctness sweep of cuda_paged against `attention_reference` (run on the H200).

Drives the backend exactly as an engine does (NaN-filled cache, permuted physical blocks with
block 0 never used, history written first, -1 padding slots, then one mixed step) across
dtypes, head sizes, block sizes, GQA ratios, window / ALiBi / soft-cap and both decode passes.
Prints one line per case and exits non-zero on any failure.

    python backends/cuda_paged/bench/check_gpu.py [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys

import torch
from pagedcore_cuda_paged import CudaPagedBackend
from pagedcore_cuda_paged.plan import DecodePass, DecodePolicy
from pagedcore_cuda_paged.torch_ref import attention_reference

from pagedcore.attention.metadata import CommonAttentionMetadata
from pagedcore.kv_cache.spec import FullAttentionSpec

TOL = {torch.float32: 1e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2}
# (context, new tokens): decodes at block edges and mid-block, prefills, chunked prefills.
REQUESTS = [(16, 1), (5, 1), (0, 1), (300, 1), (47, 1), (0, 70), (33, 16), (10, 130), (64, 2)]


def slopes(n: int) -> list[float]:
    return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]


def run_case(dtype: torch.dtype, head: int, block: int, hkv: int, group: int, *,
             window: int | None, alibi: bool, cap: float | None, force: DecodePass | None,
             seed: int, device: str = "cuda", reqs: list[tuple[int, int]] | None = None,
             partition_size: int = 64, group_heads: bool = True,
             lane_per_key: bool = False) -> float:
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
    policy = DecodePolicy(partition_size=partition_size, force=force, group_heads=group_heads)
    builder = CudaPagedBackend.get_builder_cls()(spec, ["l"], dev, policy=policy,
                                                 prefill_lane_per_key=lane_per_key)
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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    dtypes = [torch.float16, torch.bfloat16, torch.float32]
    heads = [64, 80, 96, 112, 128, 256]
    cases = []
    for dtype, head, block in itertools.product(dtypes, heads, [8, 16, 32]):
        cases.append(dict(dtype=dtype, head=head, block=block, hkv=2, group=4, window=None,
                          alibi=False, cap=None, force=None, group_heads=True))
    for dtype, group, force, grouped in itertools.product(
            dtypes, [1, 4, 7, 8], [DecodePass.ONE_PASS, DecodePass.PARTITIONED], [True, False]):
        cases.append(dict(dtype=dtype, head=128, block=16, hkv=2, group=group, window=None,
                          alibi=False, cap=None, force=force, group_heads=grouped))
    for dtype, (window, alibi, cap), force, grouped in itertools.product(
            dtypes, [(37, False, None), (8, False, None), (None, True, None),
                     (None, False, 5.0), (50, True, 5.0)],
            [DecodePass.ONE_PASS, DecodePass.PARTITIONED], [True, False]):
        for block in (8, 32):
            cases.append(dict(dtype=dtype, head=64, block=block, hkv=2, group=4, window=window,
                              alibi=alibi, cap=cap, force=force, group_heads=grouped))
    for dtype, head in itertools.product(dtypes, [80, 256]):  # grouped, group 16 (two sweeps)
        cases.append(dict(dtype=dtype, head=head, block=16, hkv=1, group=16, window=None,
                          alibi=True, cap=None, force=DecodePass.PARTITIONED, group_heads=True))
    for dtype, head, (window, alibi, cap) in itertools.product(
            dtypes, [64, 128, 256], [(None, False, None), (37, True, 5.0)]):
        cases.append(dict(dtype=dtype, head=head, block=16, hkv=2, group=4, window=window,
                          alibi=alibi, cap=cap, force=None, group_heads=True,
                          lane_per_key=True))
    if args.quick:
        cases = cases[::7]
    failures = 0
    for i, c in enumerate(cases):
        try:
            err = run_case(seed=i, **c)  # type: ignore[arg-type]
            ok = err <= TOL[c["dtype"]]  # NaN compares False
            msg = f"rel_err={err:.2e}"
        except Exception as exc:  # report and continue
            ok, msg = False, f"{type(exc).__name__}: {exc}"
        failures += not ok
        desc = " ".join(f"{k}={str(v).removeprefix('torch.')}" for k, v in c.items())
        print(f"{'PASS' if ok else 'FAIL'} {desc} {msg}", flush=True)
    torch.cuda.synchronize()
    print(f"{len(cases) - failures}/{len(cases)} passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
