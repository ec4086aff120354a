"""The ``cascade`` case of `pagedcore bench kernels`: a shared-prefix decode step, plain vs
cascade attention, for every backend that declares ``supports_cascade``.

``num_reqs`` decoding requests hold the same ``prefix`` tokens in the same physical blocks
plus ``own`` tokens each and one new token (issue #26's target: 64 x (4,096 + 256)). Each
backend writes the cache through its own ``do_kv_cache_update`` into a NaN-filled cache (so
every slot no request owns is NaN), then one ``forward`` is timed planned plainly and planned
with ``common_prefix_len`` (`pagedcore.attention.cascade.common_prefix_len` of the tables).
The row also times the same batch with every prefix a private copy (nothing shared: the
engine's planner finds ``P = 0`` and the step is the plain one; ``planner_host_us`` is what
finding that costs the host per step) and checks both results against SDPA on contiguous K/V.
Backends declaring ``supports_cascade_cudagraph`` also get the plans their decode CUDA graphs
capture (``graph_cascade_ms``: `MetadataBuilder.build_cascade_for_cudagraph_capture` with the
prefix length on the device; ``graph_plain_ms``: ``build_for_cudagraph_capture``), run
eagerly.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from pagedcore.bench.kernel_primitives import DEFAULT_HEADS, HeadShape, time_ms

if TYPE_CHECKING:
    import torch

    from pagedcore.attention import AttentionBackend, CommonAttentionMetadata

__all__ = ["bench_cascade"]


def _common(tables: list[list[int]], seq: int, block_size: int,
            device: torch.device) -> CommonAttentionMetadata:
    import torch

    from pagedcore.attention import CommonAttentionMetadata

    n = len(tables)
    table = torch.zeros((n, max(len(t) for t in tables) + 1), dtype=torch.int32)
    for r, t in enumerate(tables):
        table[r, : len(t)] = torch.tensor(t, dtype=torch.int32)
    qsl = torch.arange(n + 1, dtype=torch.int32)
    lens = torch.full((n,), seq, dtype=torch.int32)
    slots = torch.tensor([t[(seq - 1) // block_size] * block_size + (seq - 1) % block_size
                          for t in tables])
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl, seq_lens=lens.to(device),
        seq_lens_cpu=lens, num_reqs=n, num_actual_tokens=n, max_query_len=1,
        max_seq_len=seq, block_table=table.to(device), slot_mapping=slots.to(device),
        positions=torch.full((n,), seq - 1, dtype=torch.int64, device=device),
    )


def _slots(table: list[int], begin: int, end: int, block_size: int) -> list[int]:
    return [table[p // block_size] * block_size + p % block_size for p in range(begin, end)]


def bench_cascade(
    num_reqs: int, prefix: int, own: int, backends: list[type[AttentionBackend]],
    device: torch.device, *, block_size: int = 16, heads: HeadShape = DEFAULT_HEADS,
) -> list[dict[str, Any]]:
    """One row per backend that declares cascade (see the module docstring), with `heads`."""
    import torch

    from pagedcore.attention.cascade import cascade_pays, common_prefix_len
    from pagedcore.bench.kernel_primitives import failure_row as _failure
    from pagedcore.bench.kernel_primitives import sdpa_reference as _sdpa

    if prefix % block_size:
        raise ValueError(f"prefix {prefix} must be a multiple of the block size {block_size}")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    seq = prefix + own + 1
    n_pfx, n_own = prefix // block_size, -(-(seq - prefix) // block_size)
    shared_ids = list(range(1, 1 + n_pfx))
    next_id = 1 + n_pfx
    shared, private = [], []
    for _ in range(num_reqs):
        mine = list(range(next_id, next_id + n_own))
        next_id += n_own
        copy = list(range(next_id, next_id + n_pfx))
        next_id += n_pfx
        shared.append(shared_ids + mine)
        private.append(copy + mine)
    num_blocks = next_id
    hq, hkv, d = heads.num_heads, heads.num_kv_heads, heads.head_size
    kp = torch.randn((prefix, hkv, d), dtype=dtype, device=device)
    vp = torch.randn_like(kp)
    ko = torch.randn((num_reqs, seq - prefix, hkv, d), dtype=dtype, device=device)
    vo = torch.randn_like(ko)
    query = torch.randn((num_reqs, hq, d), dtype=dtype, device=device)
    k4 = torch.cat([kp.expand(num_reqs, -1, -1, -1), ko], 1).transpose(1, 2)
    v4 = torch.cat([vp.expand(num_reqs, -1, -1, -1), vo], 1).transpose(1, 2)
    ref = _sdpa(query.unsqueeze(2), k4, v4, causal=False).squeeze(2)
    del k4, v4
    slot = torch.tensor(
        _slots(shared_ids, 0, prefix, block_size)
        + [s for t in private for s in _slots(t, 0, prefix, block_size)]
        + [s for t in shared for s in _slots(t, prefix, seq, block_size)], device=device)
    keys = torch.cat([kp, kp.repeat(num_reqs, 1, 1), ko.flatten(0, 1)])
    values = torch.cat([vp, vp.repeat(num_reqs, 1, 1), vo.flatten(0, 1)])
    common = _common(shared, seq, block_size, device)
    common_private = _common(private, seq, block_size, device)
    contexts = [seq - 1] * num_reqs
    p = common_prefix_len(shared, contexts, block_size)
    start = time.perf_counter()
    reps = 100
    for _ in range(reps):
        p_private = common_prefix_len(private, contexts, block_size)
    planner_us = (time.perf_counter() - start) / reps * 1e6
    assert p == prefix and p_private == 0, (p, p_private)
    shape = f"{num_reqs}x({prefix}+{own})"
    rows: list[dict[str, Any]] = []
    step = {"query": query, "new_k": ko[:, -1], "new_v": vo[:, -1], "keys": keys,
            "values": values, "slots": slot, "num_blocks": num_blocks,
            "block_size": block_size, "dtype": dtype, "ref": ref, "heads": heads,
            "plans": {"plain": (common, 0), "cascade": (common, p),
                      "private": (common_private, p_private)}}
    for backend in backends:
        if not backend.supports_cascade:
            continue
        try:
            row = _backend_row(backend, step, device)
        except Exception as exc:  # one failing backend must not sink the others' figures
            rows.append(_failure("cascade", shape, backend.name, exc))
            continue
        rows.append({"case": "cascade", "shape": shape, "impl": backend.name, **row,
                     "common_prefix_len": p, "cascade_pays": cascade_pays(p, num_reqs),
                     "planner_host_us": planner_us})
    return rows


def _backend_row(backend: type[AttentionBackend], step: dict[str, Any],
                 device: torch.device) -> dict[str, Any]:
    """Plain, cascade and private-prefix times of one backend, and their errors vs SDPA."""
    import torch

    from pagedcore.bench.kernel_primitives import rel_error as _rel
    from pagedcore.kv_cache.spec import FullAttentionSpec

    bs, dtype, query = step["block_size"], step["dtype"], step["query"]
    heads: HeadShape = step["heads"]
    hkv, d = heads.num_kv_heads, heads.head_size
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=hkv, head_size=d, dtype=dtype)
    shape = backend.get_kv_cache_shape(step["num_blocks"], bs, hkv, d, "auto")
    cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    builder = backend.get_builder_cls()(spec, ["bench"], device)
    impl = backend.get_impl_cls()(heads.num_heads, d, d**-0.5, num_kv_heads=hkv)
    keys, values, slots = step["keys"], step["values"], step["slots"]
    chunk = 1 << 16
    for a in range(0, keys.shape[0], chunk):
        impl.do_kv_cache_update(keys[a:a + chunk], values[a:a + chunk], cache,
                                slots[a:a + chunk])
    times, outs = {}, {}
    for kind, (common, prefix_len) in step["plans"].items():
        meta = builder.build(common, common_prefix_len=prefix_len)
        out = outs[kind] = torch.empty_like(query)

        def run(meta: Any = meta, out: torch.Tensor = out) -> Any:
            return impl.forward(query, step["new_k"], step["new_v"], cache, meta, output=out)

        run()
        times[kind] = time_ms(run, device)
    graph: dict[str, Any] = {}
    if backend.supports_cascade_cudagraph:  # the plans a decode graph captures, run eagerly
        common, prefix_len = step["plans"]["cascade"]
        plen = torch.tensor([prefix_len], dtype=torch.int32, device=device)
        plans = {"graph_cascade": builder.build_cascade_for_cudagraph_capture(
                     common, plen, int(common.block_table.shape[1]) * bs),
                 "graph_plain": builder.build_for_cudagraph_capture(common)}
        builder.prepare_replay(plans["graph_cascade"], common)
        for kind, meta in plans.items():
            out = outs[kind] = torch.empty_like(query)

            def run_plan(meta: Any = meta, out: torch.Tensor = out) -> Any:
                return impl.forward(query, step["new_k"], step["new_v"], cache, meta,
                                    output=out)

            run_plan()
            times[kind] = time_ms(run_plan, device)
        graph = {"graph_cascade_ms": times["graph_cascade"],
                 "graph_plain_ms": times["graph_plain"],
                 "graph_speedup": times["graph_plain"] / times["graph_cascade"],
                 "rel_err_graph_cascade_vs_sdpa": _rel(outs["graph_cascade"], step["ref"])}
    ref = step["ref"]
    return {
        **graph,
        "ms": times["cascade"], "plain_ms": times["plain"],
        "speedup": times["plain"] / times["cascade"], "unshared_ms": times["private"],
        "rel_err_vs_sdpa": _rel(outs["cascade"], ref),
        "rel_err_plain_vs_sdpa": _rel(outs["plain"], ref),
        "rel_err_unshared_vs_sdpa": _rel(outs["private"], ref),
        "nan": bool(torch.isnan(outs["cascade"]).any()),
    }
