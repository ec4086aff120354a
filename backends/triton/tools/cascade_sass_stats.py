"""Registers, spills, shared memory and programs per SM of the cascade launches, offline.

Compiles `cascade_prefix_kernel` (prefix shapes: ``PAGEDCORE_TRITON_CASCADE_PREFIX`` texts,
``BLOCK_M,TILE_N,warps,stages[,programs_per_sm[,rN]]``) and the suffix launch of issue 26's
target step (`paged_attention_kernel` for single-token decodes, 4 query heads per KV head,
with the prefix merge fused in: ``PAGEDCORE_TRITON_DECODE_TILES`` texts ``TILE_N,warps,
stages[,rN]``) for sm_90 with the installed Triton (no GPU needed; bf16, head size 128,
block size 16), and prints one JSON line per shape with the programs one SM holds by
registers (65,536 per SM, allocated per warp in multiples of 8 per thread) and by shared
memory (227 KB per program at most, 228 KB per SM, 1 KB reserved per program)::

    python backends/triton/tools/cascade_sass_stats.py --prefix 64,64,4,3 64,32,8,3,2,r128 \\
        --suffix 32,4,4 32,2,3

Run it with the Triton the GPU machine has (3.6 for the H200 image): register counts
differ between Triton versions.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

REGS_PER_SM = 65536
SMEM_PER_SM = 228 * 1024
SMEM_RESERVED_PER_PROGRAM = 1024
MAX_WARPS_PER_SM = 64


def programs_per_sm(regs: int, warps: int, smem: int) -> dict[str, int]:
    """How many programs of `warps` warps using `regs` registers per thread and `smem`
    bytes of shared memory one Hopper SM holds, by each limit and overall."""
    per_warp = -(-regs // 8) * 8 * 32
    by_regs = REGS_PER_SM // (per_warp * warps)
    by_smem = SMEM_PER_SM // (smem + SMEM_RESERVED_PER_PROGRAM) if smem else 32
    by_warps = MAX_WARPS_PER_SM // warps
    return {"by_registers": by_regs, "by_shared_memory": by_smem,
            "programs_per_sm": min(by_regs, by_smem, by_warps)}


def _facts(compiled: Any, warps: int) -> dict[str, Any]:
    from sass_stats import cubin_facts

    regs, stack, _ = cubin_facts(compiled.asm["cubin"])
    smem = int(compiled.metadata.shared)
    row: dict[str, Any] = {"registers": regs, "stack_bytes": stack, "shared_bytes": smem}
    if regs is not None:
        row.update(programs_per_sm(regs, warps, smem))
    return row


def prefix_stats(text: str) -> dict[str, Any]:
    """`cascade_prefix_kernel` compiled for sm_90 in the shape `text`."""
    from pagedcore_triton.cascade import prefix_config
    from pagedcore_triton.kernels.cascade import cascade_prefix_kernel
    from sass_stats import compile_for_sm90

    cfg = prefix_config(num_tokens=64, num_heads=32, num_kv_heads=8, head_size=128,
                        block_size=16, prefix_len=4096, num_sms=132, override=text)
    consts = {"HEAD_SIZE": 128, "HEAD_PAD": 128, "BLOCK_SIZE": 16, "QPK": 4,
              "BLOCK_M": cfg.block_m, "TILE_N": cfg.tile_n, "NUM_SEGMENTS": cfg.segments,
              "USE_SOFTCAP": False, "DOT_FP32": False, "STAGES": cfg.num_stages,
              "PREFIX_FROM_PTR": False}
    types = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "part_acc_ptr": "*fp32",
             "part_ml_ptr": "*fp32", "scale": "fp32", "soft_cap": "fp32"}
    compiled = compile_for_sm90(cascade_prefix_kernel, consts, types, cfg.num_warps,
                                cfg.num_stages, maxnreg=cfg.maxnreg)
    return {"launch": "prefix", "shape": text, "segments": cfg.segments,
            "programs": cfg.m_tiles * 8 * cfg.segments, "warps": cfg.num_warps,
            **_facts(compiled, cfg.num_warps)}


def suffix_stats(text: str) -> dict[str, Any]:
    """The target step's suffix launch (decode, fused prefix merge of 8 segments)."""
    from pagedcore_triton.kernels.attention import paged_attention_kernel
    from pagedcore_triton.plan import parse_decode_tiles, tile_config
    from sass_stats import compile_for_sm90

    base = tile_config(1, 4, 128, interpreting=False)
    cfg = parse_decode_tiles(text, base)
    consts = {"HEAD_SIZE": 128, "HEAD_PAD": 128, "BLOCK_SIZE": 16, "QPK": 4,
              "BLOCK_Q": cfg.block_q, "BLOCK_M": cfg.block_m, "TILE_N": cfg.tile_n,
              "CAUSAL": True, "USE_ALIBI": False, "USE_SOFTCAP": False, "USE_WINDOW": False,
              "NUM_SEGMENTS": 1, "DOT_FP32": False,
              "SKIP_INTERIOR_MASKS": cfg.skip_interior_masks, "LONGEST_FIRST": False,
              "EDGE_STAGES": None, "OFF32": cfg.int32_offsets, "FLAT": False,
              "MIN_SEGMENT_TILES": 1, "REQ_PAD": 1, "KV_FP8": False, "USE_SINKS": False,
              "KV_CVT": 0, "PREFIX_SEGMENTS": 8}
    consts = {k: v for k, v in consts.items() if k in paged_attention_kernel.arg_names}
    types = {p: "*bf16" for p in ("out_ptr", "q_ptr", "k_cache_ptr", "alibi_ptr",
                                  "k_scale_ptr", "v_scale_ptr", "sinks_ptr")}
    types.update(part_acc_ptr="*fp32", part_ml_ptr="*fp32", scale="fp32", soft_cap="fp32")
    compiled = compile_for_sm90(paged_attention_kernel, consts, types, cfg.num_warps,
                                cfg.num_stages, maxnreg=cfg.maxnreg)
    return {"launch": "suffix", "shape": text, "programs": 64 * 8, "warps": cfg.num_warps,
            **_facts(compiled, cfg.num_warps)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefix", nargs="*", default=["64,64,4,3,2"],
                    help="prefix shapes (PAGEDCORE_TRITON_CASCADE_PREFIX texts)")
    ap.add_argument("--suffix", nargs="*", default=["32,4,4"],
                    help="suffix shapes (PAGEDCORE_TRITON_DECODE_TILES texts)")
    args = ap.parse_args(argv)
    import triton

    jobs = [(prefix_stats, t) for t in args.prefix] + [(suffix_stats, t) for t in args.suffix]
    for fn, text in jobs:
        try:
            row = fn(text)
        except Exception as exc:  # a shape the compiler rejects
            row = {"shape": text, "error": f"{type(exc).__name__}: {exc}"[:300]}
        row["triton"] = triton.__version__
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
