"""Measurements behind the Triton backend's launch rules (run on the GPU; writes JSON).

1. decode tile shapes (one pass), 2. the split-KV sweep (segments x batch x context) from which
`SplitRule`'s defaults come, 3. prefill tile shapes, 4. a mixed batch as one unified launch vs
separate decode/prefill launches. Usage: ``python backends/triton/tools/tune_h200.py OUT.json``.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch
from pagedcore_triton import TritonAttentionBackend
from pagedcore_triton.ops import paged_attention
from pagedcore_triton.plan import LaunchPart, TileConfig, tile_config

from pagedcore.bench.kernels import (
    BLOCK_SIZE,
    HEAD_SIZE,
    NUM_HEADS,
    NUM_KV_HEADS,
    BackendUnderTest,
    PagedKV,
    time_ms,
)

DEV = torch.device("cuda")
DT = torch.bfloat16


def _setup(seq_lens: list[int], q_lens: list[int]) -> tuple[BackendUnderTest, Any, torch.Tensor]:
    kv = PagedKV(seq_lens, DT, DEV)
    under = BackendUnderTest(TritonAttentionBackend, kv)
    md = under.builder.build(kv.common(q_lens, list(range(len(seq_lens)))))
    query = torch.randn((sum(q_lens), NUM_HEADS, HEAD_SIZE), dtype=DT, device=DEV)
    return under, md, query


def _launcher(under: BackendUnderTest, md: Any, query: torch.Tensor, out: torch.Tensor,
              part: LaunchPart, tiles: TileConfig | None) -> Any:
    def run() -> None:
        paged_attention(query, under.kv_cache, out, query_start_loc=md.query_start_loc,
                        seq_lens=md.seq_lens, block_table=md.block_table, part=part,
                        scale=HEAD_SIZE**-0.5, tiles=tiles)
    return run


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _kv_gbps(batch: int, ctx: int, ms: float) -> float:
    return 2 * batch * ctx * NUM_KV_HEADS * HEAD_SIZE * 2 / ms / 1e6


def decode_tiles(rows: list[dict[str, Any]]) -> None:
    for batch, ctx in [(64, 4096), (256, 1024)]:
        under, md, query = _setup([ctx] * batch, [1] * batch)
        part = LaunchPart(req_begin=0, req_end=batch, token_begin=0, token_end=batch,
                          max_query_len=1)
        base = torch.empty_like(query)
        _launcher(under, md, query, base, part, None)()
        for tile_n, warps, stages in [(32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 4, 4),
                                      (128, 4, 2), (128, 4, 3), (128, 8, 3), (64, 2, 3)]:
            tiles = TileConfig(block_m=16, block_q=4, tile_n=tile_n, num_warps=warps,
                               num_stages=stages)
            out = torch.empty_like(query)
            run = _launcher(under, md, query, out, part, tiles)
            ms = time_ms(run, DEV, budget_ms=100)
            rows.append({"test": "decode_tiles", "shape": f"{batch}x{ctx}", "tile_n": tile_n,
                         "warps": warps, "stages": stages, "ms": ms,
                         "kv_GBps": _kv_gbps(batch, ctx, ms), "err": _rel(out, base)})
        del under


def split_sweep(rows: list[dict[str, Any]]) -> None:
    for ctx in [8192, 32768]:
        for batch in [1, 4, 8, 16, 32, 64]:
            under, md, query = _setup([ctx] * batch, [1] * batch)
            base = torch.empty_like(query)
            for segments in [1, 2, 4, 8, 16, 32, 64]:
                if ctx // segments < 128:
                    continue
                part = LaunchPart(req_begin=0, req_end=batch, token_begin=0, token_end=batch,
                                  max_query_len=1, num_segments=segments)
                out = base if segments == 1 else torch.empty_like(query)
                run = _launcher(under, md, query, out, part, None)
                ms = time_ms(run, DEV, budget_ms=60)
                rows.append({"test": "split", "batch": batch, "ctx": ctx,
                             "programs": batch * NUM_KV_HEADS, "segments": segments, "ms": ms,
                             "kv_GBps": _kv_gbps(batch, ctx, ms), "err": _rel(out, base)})
            del under


def prefill_tiles(rows: list[dict[str, Any]]) -> None:
    for length in (2048, 8192):
        _prefill_tiles(rows, 4, length)


def _prefill_tiles(rows: list[dict[str, Any]], batch: int, length: int) -> None:
    under, md, query = _setup([length] * batch, [length] * batch)
    part = LaunchPart(req_begin=0, req_end=batch, token_begin=0, token_end=batch * length,
                      max_query_len=length)
    base = torch.empty_like(query)
    _launcher(under, md, query, base, part, None)()
    flops = 4 * HEAD_SIZE * NUM_HEADS * batch * length * (length + 1) // 2
    for bm, tn, warps, stages in [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2),
                                  (128, 128, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3),
                                  (128, 64, 4, 3), (128, 32, 8, 3)]:
        tiles = TileConfig(block_m=bm, block_q=bm // 4, tile_n=tn, num_warps=warps,
                           num_stages=stages)
        out = torch.empty_like(query)
        try:
            run = _launcher(under, md, query, out, part, tiles)
            ms = time_ms(run, DEV, budget_ms=150)
            rows.append({"test": "prefill_tiles", "length": length, "block_m": bm,
                         "tile_n": tn, "warps": warps, "stages": stages, "ms": ms,
                         "TFLOPs": flops / ms / 1e9,
                         "err": _rel(out, base)})
        except Exception as exc:  # out of shared memory etc.
            rows.append({"test": "prefill_tiles", "length": length, "block_m": bm, "tile_n": tn,
                         "error": str(exc)[:200]})


def mixed(rows: list[dict[str, Any]]) -> None:
    decodes, ctx, chunk, prefix = 64, 4096, 2048, 2048
    q_lens = [1] * decodes + [chunk]
    under, md, query = _setup([ctx] * decodes + [prefix + chunk], q_lens)
    one = LaunchPart(req_begin=0, req_end=decodes + 1, token_begin=0, token_end=decodes + chunk,
                     max_query_len=chunk)
    dec = LaunchPart(req_begin=0, req_end=decodes, token_begin=0, token_end=decodes,
                     max_query_len=1)
    pre = LaunchPart(req_begin=decodes, req_end=decodes + 1, token_begin=decodes,
                     token_end=decodes + chunk, max_query_len=chunk)
    out1, out2 = torch.empty_like(query), torch.empty_like(query)
    r1 = _launcher(under, md, query, out1, one, None)
    rd = _launcher(under, md, query, out2, dec, None)
    rp = _launcher(under, md, query, out2, pre, None)

    def both() -> None:
        rd()
        rp()

    rows.append({"test": "mixed", "unified_one_launch_ms": time_ms(r1, DEV),
                 "decode_then_prefill_launches_ms": time_ms(both, DEV),
                 "decode_only_ms": time_ms(rd, DEV), "prefill_only_ms": time_ms(rp, DEV),
                 "err": _rel(out1, out2)})


def main() -> None:
    rows: list[dict[str, Any]] = []
    t0 = time.time()
    steps = [split_sweep, prefill_tiles, mixed]
    if "--decode-tiles" in sys.argv:
        steps.insert(0, decode_tiles)
    for step in steps:
        step(rows)
        torch.cuda.empty_cache()
        print(f"{step.__name__} done at {time.time() - t0:.0f}s", flush=True)
    info = {"device": torch.cuda.get_device_name(), "tile_default_decode":
            str(tile_config(1, 4, 128, interpreting=False)),
            "tile_default_prefill": str(tile_config(2048, 4, 128, interpreting=False)),
            "block_size": BLOCK_SIZE, "rows": rows}
    with open(sys.argv[1], "w") as f:
        json.dump(info, f, indent=1)
    for r in rows:
        if r["test"] != "split":
            print(r)
    best: dict[tuple[int, int], tuple[float, int]] = {}
    for r in rows:
        if r["test"] == "split":
            key = (r["ctx"], r["batch"])
            if key not in best or r["ms"] < best[key][0]:
                best[key] = (r["ms"], r["segments"])
    one_pass = {(r["ctx"], r["batch"]): r["ms"] for r in rows
                if r["test"] == "split" and r["segments"] == 1}
    for key, (ms, seg) in sorted(best.items()):
        print(f"ctx={key[0]} batch={key[1]} best_segments={seg} {ms:.4f}ms "
              f"one_pass={one_pass[key]:.4f}ms "
              f"best_GBps={_kv_gbps(key[1], key[0], ms):.0f}")


if __name__ == "__main__":
    main()
