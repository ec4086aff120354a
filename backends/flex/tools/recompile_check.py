"""Count torch.compile graphs over steps of changing lengths, and time the K/V gather's share
of a forward (GPU check, not a CI test).

Steps whose padded query / key lengths fall into the same buckets must reuse the compiled
flex kernel: prints the buckets seen and dynamo's compile counters, and exits 1 when more
graphs were compiled than (bucket pairs x 2), the 2 allowing for the block-mask compile.
"""

from __future__ import annotations

import sys
import time

import torch
from torch._dynamo.utils import counters

from pagedcore import select_backend
from pagedcore.attention.metadata import CommonAttentionMetadata
from pagedcore.kv_cache.spec import FullAttentionSpec

BLOCK, HQ, HKV, D, NUM_BLOCKS = 16, 32, 8, 128, 4096


def step(lens: list[tuple[int, int]], device: torch.device) -> CommonAttentionMetadata:
    qlens = torch.tensor([q for _, q in lens], dtype=torch.int32)
    seq = torch.tensor([c + q for c, q in lens], dtype=torch.int32)
    qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(qlens, 0)
    width = int(seq.max()) // BLOCK + 1
    bt = torch.randperm(NUM_BLOCKS - 1)[: len(lens) * width].view(len(lens), width) + 1
    pos = torch.cat([torch.arange(c, c + q) for c, q in lens])
    req = torch.repeat_interleave(torch.arange(len(lens)), qlens.long())
    slots = bt[req, pos // BLOCK].long() * BLOCK + pos % BLOCK
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl, seq_lens=seq.to(device),
        seq_lens_cpu=seq, num_reqs=len(lens), num_actual_tokens=int(qsl[-1]),
        max_query_len=int(qlens.max()), max_seq_len=int(seq.max()),
        block_table=bt.to(torch.int32).to(device), slot_mapping=slots.to(device),
        positions=pos.to(device), causal=True,
    )


def main() -> int:
    device = torch.device("cuda")
    backend = select_backend(head_size=D, dtype="bfloat16", block_size=BLOCK, device="cuda",
                             backend="flex")
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HKV, head_size=D, dtype="bfloat16")
    builder = backend.get_builder_cls()(spec, ["l0"], device)
    impl = backend.get_impl_cls()(HQ, D, D**-0.5, num_kv_heads=HKV)
    cache = torch.randn(backend.get_kv_cache_shape(NUM_BLOCKS, BLOCK, HKV, D), device=device,
                        dtype=torch.bfloat16)
    buckets = set()
    for i in range(12):
        # 32 decodes with context 900..1000: T pads to 128, S to 32768 every time.
        lens = [(900 + (7 * i + r) % 100, 1) for r in range(32)]
        common = step(lens, device)
        md = builder.build(common)
        buckets.add((md.padded_query_len, md.padded_kv_len))
        q = torch.randn(common.num_actual_tokens, HQ, D, device=device, dtype=torch.bfloat16)
        t0 = time.perf_counter()
        impl.forward(q, q[:, :HKV], q[:, :HKV], cache, md)
        torch.cuda.synchronize()
        print(f"step {i}: buckets {sorted(buckets)} {1e3 * (time.perf_counter() - t0):.1f} ms")
    # The gather's share of a warm forward (the design's one copy: sum(seq_lens) rows of K, V).
    flat = cache[0].view(-1, HKV, D)
    reps = 20
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        flat.index_select(0, md.kv_slots.view(-1))
        cache[1].view(-1, HKV, D).index_select(0, md.kv_slots.view(-1))
    torch.cuda.synchronize()
    gather_ms = 1e3 * (time.perf_counter() - t0) / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        impl.forward(q, q[:, :HKV], q[:, :HKV], cache, md)
    torch.cuda.synchronize()
    forward_ms = 1e3 * (time.perf_counter() - t0) / reps
    print(f"32 decodes x ~950 keys (layout {md.flex_batch} x {md.padded_kv_len}): "
          f"gather {gather_ms:.3f} ms of forward {forward_ms:.3f} ms")
    unique = counters["stats"]["unique_graphs"]
    print(f"buckets {sorted(buckets)}; dynamo unique_graphs {unique}; "
          f"frames {dict(counters['frames'])}")
    return 0 if unique <= 2 * len(buckets) else 1


if __name__ == "__main__":
    sys.exit(main())
