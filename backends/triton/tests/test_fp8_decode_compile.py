"""The fp8 decode launch the shipped defaults make (`tile_config` with a 1-byte cache and its
``KV_CVT``) compiles for sm_90 (Triton's front end and ptxas, no GPU needed) for e4m3 and
e5m2 caches: the interpreter never runs the float16-operand branches (it keeps ``KV_CVT`` 0).
"""

from __future__ import annotations

from pathlib import Path

from _sm90 import compile_script_for_sm90

_SCRIPT = r"""
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from pagedcore_triton.kernels.attention import paged_attention_kernel as kernel
from pagedcore_triton.plan import kv_convert, tile_config

cfg = tile_config(1, 4, 128, interpreting=False, itemsize=2, kv_itemsize=1)
cvt = kv_convert(cfg, kv_fp8=True, itemsize=2, interpreting=False)
assert cvt == cfg.kv_convert, (cvt, cfg)
for cache in ("*fp8e4nv", "*fp8e5"):
    c = dict(HEAD_SIZE=128, HEAD_PAD=128, BLOCK_SIZE=16, QPK=4, BLOCK_Q=cfg.block_q,
             BLOCK_M=cfg.block_m, TILE_N=cfg.tile_n, CAUSAL=True, USE_ALIBI=False,
             USE_SOFTCAP=False, USE_WINDOW=False, NUM_SEGMENTS=8, DOT_FP32=False,
             SKIP_INTERIOR_MASKS=cfg.skip_interior_masks, LONGEST_FIRST=False, EDGE_STAGES=None,
             OFF32=cfg.int32_offsets, FLAT=False, MIN_SEGMENT_TILES=1, REQ_PAD=1, KV_FP8=True,
             USE_SINKS=False, KV_CVT=cvt)
    types = {"out_ptr": "*bf16", "q_ptr": "*bf16", "k_cache_ptr": cache, "alibi_ptr": "*fp32",
             "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "k_scale_ptr": "*fp32",
             "v_scale_ptr": "*fp32", "sinks_ptr": "*fp32", "scale": "fp32", "soft_cap": "fp32"}
    sig = {n: "constexpr" if n in c else types.get(n, "*i32" if n.endswith("_ptr") else "i32")
           for n in kernel.arg_names}
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    if cfg.maxnreg is not None:
        options["maxnreg"] = cfg.maxnreg
    triton.compile(ASTSource(kernel, sig, c), target=GPUTarget("cuda", 90, 32), options=options)
    print("ok", cache, "KV_CVT", cvt, flush=True)
"""


def test_fp8_decode_default_compiles_for_sm90(tmp_path: Path) -> None:
    stdout = compile_script_for_sm90(_SCRIPT, tmp_path)
    assert stdout.count("ok ") == 2, stdout
