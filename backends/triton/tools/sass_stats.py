"""Registers, spills, shared memory and the interior loop's instructions of prefill variants.

Compiles `paged_attention_kernel` for sm_90 (H100/H200) with the installed Triton, without a
GPU, for the benchmark's specialization (bf16, 32 query / 8 KV heads, head size 128, block
size 16, causal), and reads the SASS with the ``ptxas`` / ``cuobjdump`` that Triton bundles::

    python backends/triton/tools/sass_stats.py default 128,128,8,2,i32 ...

A variant is a ``PAGEDCORE_TRITON_PREFILL_TILES`` value (``default`` = the shipped prefill
tiles), see `pagedcore_triton.plan.parse_tiles`. Per variant it prints one JSON line:
registers per thread, stack (spill) bytes, static shared memory, and for the unmasked interior
loop (the first loop with tensor-core instructions and no ``FSEL``) the instructions per
iteration and per thread, the local-memory accesses (spills inside the loop) and
``warp_instr_per_score``:
issued warp instructions per score element of the tile, the issue cost that the MMAs must hide
(an H200 SM issues 4 warp instructions per clock and does ~4,000 bf16 MMA FLOPs per clock,
i.e. ~16 per score of a 128-dim head). Used to pick the variants measured in
``docs/benchmarks/triton.md``.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

KERNEL = Path(__file__).resolve().parent.parent / "pagedcore_triton" / "kernels" / "attention.py"
PLAN = KERNEL.parent.parent / "plan.py"


def _load(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def sass_loops(sass: str) -> list[Counter[str]]:
    """Opcode counts of each loop body (a backward branch's target .. the branch)."""
    ins: list[tuple[int, str]] = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            words = m.group(2).split()
            op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
            ins.append((int(m.group(1), 16), m.group(2) if op == "BRA" else op.split(".")[0]))
    loops = []
    for addr, text in ins:
        target = re.search(r"BRA\b.*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr:
            lo = int(target.group(1), 16)
            loops.append(Counter(op.split()[0] for a, op in ins if lo <= a <= addr))
    return loops


def cubin_facts(cubin: bytes) -> tuple[int | None, int | None, str]:
    """Registers per thread, stack (spill) bytes and the SASS of a compiled kernel's cubin,
    from the ``cuobjdump`` Triton bundles (its ``ptxas`` may be older than the PTX Triton
    writes, so the cubin is read, not recompiled)."""
    import triton

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        usage = subprocess.run([str(tools / "cuobjdump"), "--dump-resource-usage", str(path)],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([str(tools / "cuobjdump"), "-sass", str(path)],
                              capture_output=True, text=True, check=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    return (int(regs.group(1)) if regs else None, int(stack.group(1)) if stack else None, sass)


def compile_for_sm90(kernel: Any, consts: dict[str, Any], types: dict[str, str],
                     num_warps: int, num_stages: int, *, maxnreg: int | None = None) -> Any:
    """``triton.compile`` of `kernel` for sm_90 (no GPU needed): `consts` become constexprs,
    `types` names the arguments that are not ``i32`` (``"*bf16"``, ``"fp32"``, a
    ``tensordesc<...>``); other ``*_ptr`` arguments are ``*i32``. Pointers, strides and
    ``v_offset`` are declared 16-divisible, as the launches guarantee. Constexpr parameters
    missing from `consts` take their declared defaults (as a launch that omits them does),
    so a kernel that gains one keeps compiling here. `maxnreg` caps registers per thread."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    consts = dict(consts)
    for param in kernel.params:
        if (param.is_constexpr and param.name not in consts
                and param.default is not inspect.Parameter.empty):
            consts[param.name] = param.default
    sig: dict[str, str] = {}
    for name in kernel.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in types:
            sig[name] = types[name]
        else:
            sig[name] = "*i32" if name.endswith("_ptr") else "i32"
    aligned = [n for n in kernel.arg_names
               if n.endswith("_ptr") or n.startswith("stride_") or n == "v_offset"]
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return triton.compile(
        ASTSource(kernel, sig, constexprs=consts, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, "num_stages": num_stages,
                 **({} if maxnreg is None else {"maxnreg": maxnreg})},
    )


def stats(variant: str) -> dict[str, Any]:
    """Compile `variant` for sm_90 and summarize its registers, spills and interior loop."""
    import triton

    kernel = _load(KERNEL, "_pc_attention").paged_attention_kernel
    plan = _load(PLAN, "_pc_plan")
    qpk = 4
    if variant == "default":
        cfg = plan.tile_config(2048, qpk, 128, interpreting=False, prefill_only=True)
    else:
        cfg = plan.parse_tiles(variant, qpk)
    consts: dict[str, Any] = {
        "HEAD_SIZE": 128, "HEAD_PAD": 128, "BLOCK_SIZE": 16, "QPK": qpk,
        "BLOCK_Q": cfg.block_q, "BLOCK_M": cfg.block_m, "TILE_N": cfg.tile_n, "CAUSAL": True,
        "USE_ALIBI": False, "USE_SOFTCAP": False, "USE_WINDOW": False, "NUM_SEGMENTS": 1,
        "DOT_FP32": False, "SKIP_INTERIOR_MASKS": cfg.skip_interior_masks,
        "LONGEST_FIRST": cfg.longest_first,
        "EDGE_STAGES": 1 if getattr(cfg, "unpipelined_edges", False) else None,
        "OFF32": getattr(cfg, "int32_offsets", False),
        "FLAT": False, "MIN_SEGMENT_TILES": 1, "REQ_PAD": 1,
    }
    consts = {k: v for k, v in consts.items() if k in kernel.arg_names}
    types = {p: "*bf16" for p in ("out_ptr", "q_ptr", "k_cache_ptr", "alibi_ptr",
                                  "part_acc_ptr", "part_ml_ptr")}
    types.update(scale="fp32", soft_cap="fp32")
    compiled = compile_for_sm90(kernel, consts, types, cfg.num_warps, cfg.num_stages)
    regs, stack, sass = cubin_facts(compiled.asm["cubin"])
    row: dict[str, Any] = {
        "variant": variant, "triton": triton.__version__, "warps": cfg.num_warps,
        "registers": regs,
        "stack_bytes": stack,
        "shared_bytes": compiled.metadata.shared,
    }
    interior = [c for c in sass_loops(sass) if c["HGMMA"] and not c["FSEL"]]
    if interior:
        body = interior[0]
        n = sum(body.values())
        row.update({
            "interior_instr": n, "interior_local_mem": body["STL"] + body["LDL"],
            "interior_exp2": body["MUFU"], "interior_async_copies": body["LDGSTS"],
            "warp_instr_per_score": round(n * cfg.num_warps / (cfg.block_m * cfg.tile_n), 3),
        })
    return row


def main() -> None:
    variants = sys.argv[1:] or ["default"]
    for variant in variants:
        try:
            print(json.dumps(stats(variant)), flush=True)
        except Exception as exc:
            print(json.dumps({"variant": variant, "error": f"{type(exc).__name__}: {exc}"}))


if __name__ == "__main__":
    main()
