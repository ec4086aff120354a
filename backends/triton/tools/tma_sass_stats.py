"""Registers, spills, shared memory and loop instructions of Hopper prefill-kernel variants.

Compiles `prefill_tma_kernel` (``kernels/prefill_tma.py``) for sm_90 with the installed
Triton, without a GPU, for the benchmark's specialization (bf16, 32 query / 8 KV heads, head
size 128, causal), one JSON line per ``PAGEDCORE_TRITON_TMA_TILES`` variant::

    python backends/triton/tools/tma_sass_stats.py 128,128,8,3 128,64,8,3,ws ...

Only triton is needed (not torch, not pagedcore): the kernel modules are loaded from their
files. Used to check that a variant compiles (TMA loads, wgmma, no spills) before a GPU run.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PKG = HERE.parent / "pagedcore_triton"


def _load(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _kernel(ws: bool = False) -> Any:
    for name in ("pagedcore_triton", "pagedcore_triton.kernels"):
        sys.modules.setdefault(name, types.ModuleType(name))
    _load(PKG / "kernels" / "merge.py", "pagedcore_triton.kernels.merge")
    _load(PKG / "kernels" / "attention.py", "pagedcore_triton.kernels.attention")
    module = sys.modules.get("_pc_prefill_tma") or _load(PKG / "kernels" / "prefill_tma.py",
                                                          "_pc_prefill_tma")
    return module.prefill_tma_ws_kernel if ws else module.prefill_tma_kernel


def _parse(variant: str) -> dict[str, Any]:
    fields = variant.split(",")
    block_m, tile_n, warps, stages = (int(f) for f in fields[:4])
    flags = fields[4:]
    diag = max([int(f[1:]) for f in flags if f.startswith("d")], default=0)
    regs = [int(f[1:]) for f in flags if f.startswith("r") and f[1:].isdigit()]
    return {"block_m": block_m, "tile_n": tile_n, "warps": warps, "stages": stages,
            "ws": "ws" in flags, "edge": 1 if "e1" in flags else stages, "diag": diag,
            "wsk": "wsk" in flags, "hm": "hm" in flags, "maxnreg": regs[0] if regs else None}


def ws_stats(variant: str) -> dict[str, Any]:
    """`stats` for a ``wsk`` variant (``prefill_tma_ws_kernel``, no cached prefix)."""
    import triton

    sys.path.insert(0, str(HERE))
    from sass_stats import compile_for_sm90, cubin_facts, sass_loops

    cfg = _parse(variant)
    consts: dict[str, Any] = {
        "HEAD_SIZE": 128, "QPK": 4, "BLOCK_M": cfg["block_m"], "TILE_N": cfg["tile_n"],
        "CAUSAL": True, "DOT_FP32": False, "SEARCH_STEPS": 3, "STAGES": cfg["stages"],
        "WARP_SPECIALIZE": True, "HEADS_FAST": cfg["hm"],
    }
    types = {"q_ptr": "*bf16",
             "k_desc": f"tensordesc<bf16[{cfg['tile_n']}, 128]>",
             "v_desc": f"tensordesc<bf16[{cfg['tile_n']}, 128]>",
             "out_ptr": "*bf16", "scale": "fp32"}
    compiled = compile_for_sm90(_kernel(ws=True), consts, types, cfg["warps"], cfg["stages"])
    regs, stack, sass = cubin_facts(compiled.asm["cubin"])
    loops = [c for c in sass_loops(sass) if c["HGMMA"]]
    return {
        "variant": variant, "prefix": False, "triton": triton.__version__,
        "warps_launched": compiled.metadata.num_warps, "setmaxnreg": sass.count("USETMAXREG"),
        "registers": regs, "stack_bytes": stack, "shared_bytes": compiled.metadata.shared,
        "loops": [{"instr": sum(c.values()), "hgmma": c["HGMMA"], "mufu": c["MUFU"],
                   "fsel": c["FSEL"], "local": c["STL"] + c["LDL"]} for c in loops],
    }


def stats(variant: str, *, prefix: bool = False) -> dict[str, Any]:
    """Compile `variant` for sm_90 and summarize registers, spills and its loops."""
    import triton

    sys.path.insert(0, str(HERE))
    from sass_stats import compile_for_sm90, cubin_facts, sass_loops

    kernel = _kernel()
    cfg = _parse(variant)
    qpk = 4
    consts: dict[str, Any] = {
        "HEAD_SIZE": 128, "BLOCK_SIZE": 16, "QPK": qpk, "BLOCK_Q": cfg["block_m"] // qpk,
        "BLOCK_M": cfg["block_m"], "TILE_N": cfg["tile_n"], "CAUSAL": True,
        "HAS_PREFIX": prefix, "DOT_FP32": False, "LONGEST_FIRST": True, "OFF32": True,
        "INNER_STAGES": cfg["stages"], "EDGE_STAGES": cfg["edge"],
        "WARP_SPECIALIZE": cfg["ws"], "DIAG_N": cfg["diag"],
    }
    tile_desc = f"tensordesc<bf16[{cfg['tile_n']}, 128]>"
    diag_desc = f"tensordesc<bf16[{cfg['diag'] or cfg['tile_n']}, 128]>"
    types = {"k_desc": tile_desc, "v_desc": tile_desc, "kd_desc": diag_desc,
             "vd_desc": diag_desc, "out_ptr": "*bf16", "q_ptr": "*bf16",
             "k_cache_ptr": "*bf16", "scale": "fp32"}
    compiled = compile_for_sm90(kernel, consts, types, cfg["warps"], cfg["stages"])
    regs, stack, sass = cubin_facts(compiled.asm["cubin"])
    loops = [c for c in sass_loops(sass) if c["HGMMA"]]
    return {
        "variant": variant, "prefix": prefix, "triton": triton.__version__,
        "registers": regs, "stack_bytes": stack, "shared_bytes": compiled.metadata.shared,
        "loops": [{"instr": sum(c.values()), "hgmma": c["HGMMA"], "tma": c["UTMALDG"],
                   "ldgsts": c["LDGSTS"], "mufu": c["MUFU"], "fsel": c["FSEL"],
                   "local": c["STL"] + c["LDL"]} for c in loops],
    }


def main() -> None:
    for variant in sys.argv[1:] or ["128,128,8,3"]:
        if "wsk" in variant.split(","):
            try:
                print(json.dumps(ws_stats(variant)), flush=True)
            except Exception as exc:
                print(json.dumps({"variant": variant,
                                  "error": f"{type(exc).__name__}: {exc}"[:2000]}), flush=True)
            continue
        for prefix in (False, True):
            try:
                print(json.dumps(stats(variant, prefix=prefix)), flush=True)
            except Exception as exc:
                print(json.dumps({"variant": variant, "prefix": prefix,
                                  "error": f"{type(exc).__name__}: {exc}"[:2000]}), flush=True)


if __name__ == "__main__":
    main()
