"""Registers, spills, shared memory and the tile loop's instructions of MLA decode variants.

Compiles `mla_decode_kernel` for sm_90 (H100/H200) with the installed Triton, without a GPU,
at the bench's specialization (bf16 query and cache, 16 heads per program, latent 512 + rope
64, block size 16, split launch), and reads the SASS with the ``cuobjdump`` that Triton
bundles::

    python backends/triton/tools/mla_sass_stats.py NAME[:KEY=VALUE,...] ...

``NAME`` is a key of `pagedcore_triton.mla_config.MLA_KERNEL_CONFIGS` (its ``block_n``,
``num_warps``, ``num_stages``, ``maxnreg``, ``lat_split``, ``rowsum_2d``); ``KEY=VALUE``
overrides a kernel constexpr (upper case, e.g. ``ROWSUM_2D=1``, ``BLOCK_N=64``) or a launch
option (``warps``, ``stages``, ``maxnreg``). Per variant it prints one JSON line: registers,
stack (spill) bytes, static shared memory, and for the tile loop (the largest loop with
``HMMA``) its instruction count and its barriers, MMAs, ``ldmatrix``, shared loads / stores,
shuffles and async copies. Install ``triton==3.6.0`` (the GPU machine's version) in a
separate environment to see what the GPU compiles. Used for the ninth run in docs/mla.md.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from typing import Any

from sass_stats import cubin_facts, sass_loops  # (this folder)


def stats(spec: str) -> dict[str, Any]:
    """Compile the variant `spec` for sm_90 and summarize its resources and tile loop."""
    import triton
    from pagedcore_triton.mla_config import MLA_KERNEL_CONFIGS
    from pagedcore_triton.mla_kernels import mla_decode_kernel as kernel
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    name, _, extra = spec.partition(":")
    cfg = MLA_KERNEL_CONFIGS[name]
    over = dict(item.split("=") for item in extra.split(",") if item)
    consts: dict[str, Any] = {
        "LATENT": 512, "LATENT_PAD": 512, "LAT_SPLIT": cfg.lat_split, "ROPE": 64,
        "ROPE_PAD": 64, "BLOCK_SIZE": 16, "BLOCK_H": 16, "BLOCK_N": cfg.block_n,
        "WRITE_PARTIAL": True, "DOT_FP32": False, "USE_PDL": cfg.pdl, "SPLIT_FIRST": False,
        "FANIN": 0, "PROBE": False, "HEADS_PER_PROG": 0, "ROWSUM_2D": cfg.rowsum_2d,
    }
    consts.update({k: int(v) for k, v in over.items() if k.isupper()})
    consts = {k: v for k, v in consts.items() if k in kernel.arg_names}
    half = "*bf16" if cfg.half_partials else "*fp32"
    sig: dict[str, str] = {}
    for arg in kernel.arg_names:
        if arg in consts:
            sig[arg] = "constexpr"
        elif arg in ("out_ptr", "q_ptr", "cache_ptr"):
            sig[arg] = "*bf16"
        elif arg == "part_acc_ptr":
            sig[arg] = half
        elif arg == "part_ml_ptr":
            sig[arg] = "*fp32"
        elif arg == "probe_ptr":
            sig[arg] = "*i64"
        elif arg.endswith("_ptr"):
            sig[arg] = "*i32"
        elif arg == "scale_log2":
            sig[arg] = "fp32"
        else:
            sig[arg] = "i32"
    aligned = [a for a in kernel.arg_names if a.endswith("_ptr") or a.startswith("stride_")]
    attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    options: dict[str, Any] = {"num_warps": int(over.get("warps", cfg.num_warps)),
                               "num_stages": int(over.get("stages", cfg.num_stages))}
    maxnreg = over.get("maxnreg") or cfg.maxnreg
    if maxnreg:
        options["maxnreg"] = int(maxnreg)
    compiled = triton.compile(ASTSource(kernel, sig, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=options)
    regs, stack, sass = cubin_facts(compiled.asm["cubin"])
    loops = [c for c in sass_loops(sass) if c["HMMA"]]
    body = max(loops, key=lambda c: sum(c.values())) if loops else Counter()
    return {
        "variant": spec, "triton": triton.__version__,
        "registers": regs,
        "stack_bytes": stack,
        "shared_bytes": compiled.metadata.shared, "loop_instr": sum(body.values()),
        **{f"loop_{op.lower()}": body[op] for op in
           ("BAR", "HMMA", "LDSM", "LDS", "STS", "SHFL", "LDGSTS")},
    }


def main() -> None:
    for spec in sys.argv[1:] or ["n32s5c4pm64R256k64mw1dhrw2v128"]:
        try:
            print(json.dumps(stats(spec)), flush=True)
        except Exception as exc:
            print(json.dumps({"variant": spec, "error": f"{type(exc).__name__}: {exc}"[:400]}))


if __name__ == "__main__":
    main()
