"""H200 check of the graph cascade plan (one attention layer, Qwen2-0.5B shape): capture
fill_graph_cascade + the cascade forward in a CUDA graph, replay at several prefix lengths,
compare with the eager cascade and the plain plan, and time replay vs eager cascade vs the
plain plan's graph. Writes JSON to $OUT/cascade_graph.json."""

from __future__ import annotations

import json
import os
import sys

import torch
from pagedcore_triton import TritonAttentionBackend
from pagedcore_triton.cascade import fill_graph_cascade

from pagedcore.attention import CommonAttentionMetadata
from pagedcore.kv_cache.spec import FullAttentionSpec

B, BUCKET, OWN, BS, HQ, HKV, D = 60, 64, 64, 16, 14, 2, 64  # 4 padded rows
DEV, DT = torch.device("cuda"), torch.bfloat16
CAP = 4096  # capacity (tokens) of the graph


def common_for(prefix: int, n: int, bucket: int, width: int) -> CommonAttentionMetadata:
    n_pfx = prefix // BS
    table = torch.zeros((bucket, width), dtype=torch.int32)
    nxt = 1 + CAP // BS
    for r in range(n):
        own = -(-(OWN + 1) // BS)
        row = list(range(1, 1 + n_pfx)) + list(range(nxt, nxt + own))
        nxt += own
        table[r, : len(row)] = torch.tensor(row)
    lens = torch.tensor([prefix + OWN + 1] * n + [0] * (bucket - n), dtype=torch.int32)
    qsl = torch.arange(bucket + 1, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(DEV), query_start_loc_cpu=qsl, seq_lens=lens.to(DEV),
        seq_lens_cpu=lens, num_reqs=bucket, num_actual_tokens=bucket, max_query_len=1,
        max_seq_len=width * BS, block_table=table.to(DEV),
        slot_mapping=torch.zeros(bucket, dtype=torch.int64, device=DEV),
        positions=(lens.clamp(min=1) - 1).to(torch.int64).to(DEV))


def timed(fn, iters: int = 50) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / iters


def main() -> int:
    out_dir = os.environ.get("OUT", ".")
    width = (CAP + OWN + 1) // BS + 2
    nblocks = 1 + CAP // BS + B * 8
    g = torch.Generator(device=DEV).manual_seed(0)
    cache = torch.randn((2, nblocks, BS, HKV, D), generator=g, device=DEV).to(DT)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HKV, head_size=D, dtype="bfloat16")
    builder = TritonAttentionBackend.get_builder_cls()(spec, ["l0"], DEV)
    impl = TritonAttentionBackend.get_impl_cls()(
        HQ, D, D ** -0.5, num_kv_heads=HKV, alibi_slopes=None, sliding_window=None,
        logits_soft_cap=None, kv_cache_dtype="auto")
    q = torch.randn((BUCKET, HQ, D), generator=g, device=DEV).to(DT)
    # Static graph inputs: the metadata of the bucket (rewritten in place per replay).
    static = common_for(CAP, B, BUCKET, width)
    pdev = torch.tensor([CAP], dtype=torch.int32, device=DEV)
    lens = torch.empty(BUCKET, dtype=torch.int32, device=DEV)
    table = torch.empty_like(static.block_table)
    meta = builder.build_cascade_for_cudagraph_capture(
        static, pdev, CAP, suffix_seq_lens=lens, suffix_table=table)
    out = torch.empty((BUCKET, HQ, D), dtype=DT, device=DEV)

    def step() -> None:
        fill_graph_cascade(static, pdev, BS, lens, table)
        out.copy_(impl.forward(q, q, q, cache, meta))

    step()  # compile, fill the launch cache
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    res: dict[str, object] = {"shape": [B, BUCKET, OWN, BS, HQ, HKV, D], "cases": []}
    ok = True
    for prefix in (CAP, CAP // 2, 1024 + 2 * BS, BS):
        c = common_for(prefix, B, BUCKET, width)
        static.seq_lens.copy_(c.seq_lens)
        static.block_table.copy_(c.block_table)
        pdev.fill_(prefix)
        graph.replay()
        torch.cuda.synchronize()
        real = common_for(prefix, B, B, width)  # the batch unpadded (eager plans)
        qr, got = q[:B], out[:B].float()
        plain = impl.forward(qr, qr, qr, cache, builder.build(real))
        eager = impl.forward(qr, qr, qr, cache, builder.build(real, common_prefix_len=prefix))
        scale = float(plain.float().abs().max())
        e_plain = float((got - plain.float()).abs().max()) / scale
        e_eager = float((got - eager.float()).abs().max()) / scale
        good = e_plain < 2e-2 and e_eager < 2e-2 and not torch.isnan(got).any()
        ok &= bool(good)
        res["cases"].append({"prefix": prefix, "rel_err_vs_plain": e_plain,  # type: ignore
                             "rel_err_vs_eager": e_eager, "ok": bool(good)})
    c = common_for(CAP, B, BUCKET, width)
    static.seq_lens.copy_(c.seq_lens)
    static.block_table.copy_(c.block_table)
    pdev.fill_(CAP)
    plain_meta = builder.build_for_cudagraph_capture(c)
    pout = torch.empty_like(out)
    pg = torch.cuda.CUDAGraph()
    pout.copy_(impl.forward(q, q, q, cache, plain_meta))
    torch.cuda.synchronize()
    with torch.cuda.graph(pg):
        pout.copy_(impl.forward(q, q, q, cache, plain_meta))
    real = common_for(CAP, B, B, width)
    eager_meta = builder.build(real, common_prefix_len=CAP)
    qr = q[:B]
    res["ms_graph_cascade_replay"] = timed(graph.replay)
    res["ms_plain_graph_replay"] = timed(pg.replay)
    res["ms_eager_cascade_one_layer"] = timed(
        lambda: impl.forward(qr, qr, qr, cache, eager_meta))
    res["ok"] = ok
    text = json.dumps(res, indent=1)
    print(text)
    with open(os.path.join(out_dir, "cascade_graph.json"), "w") as f:
        f.write(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
