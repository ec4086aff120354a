"""The balanced decode kernels (with and without fp8 caches and sinks) compile for sm_90
(Triton's front end and ptxas, no GPU needed).

Triton's interpreter runs the kernels as Python and misses what only the compiler checks (a
variable that is a vector in one ``constexpr`` branch and a scalar in another failed to
compile on the H200 while every interpreter test passed). This compiles every program order
and feature combination for an H100/H200 target in a subprocess without
``TRITON_INTERPRET`` (~1 s per variant).
"""

from __future__ import annotations

from pathlib import Path

from _sm90 import compile_script_for_sm90

_SCRIPT = r"""
import itertools, triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from pagedcore_triton.kernels.balanced import balanced_decode_kernel, balanced_merge_kernel

from pagedcore_triton.plan import tile_config

target = GPUTarget("cuda", 90, 32)
FP8_CVT = tile_config(1, 4, 128, interpreting=False, kv_itemsize=1).kv_convert  # the default
types = {"out_ptr": "*bf16", "q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_offset": "i64",
         "alibi_ptr": "*fp32", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32",
         "scale": "fp32", "soft_cap": "fp32"}

def sig(fn, consts, **extra):
    t = {**types, **extra}
    return {n: "constexpr" if n in consts else t.get(n, "*i32" if n.endswith("_ptr")
            else "i32") for n in fn.arg_names}

for heads_first, rr, features in itertools.product([False, True], [False, True], [False, True]):
    c = dict(HEAD_SIZE=128, HEAD_PAD=128, BLOCK_SIZE=16, QPK=4, BLOCK_M=16, TILE_N=64,
             USE_ALIBI=features, USE_SOFTCAP=features, USE_WINDOW=features, DOT_FP32=False,
             OFF32=False, MIN_TILES=4, REQ_PAD=32, HEADS_FIRST=heads_first, ROUND_ROBIN=rr,
             KV_FP8=features, USE_SINKS=features, KV_CVT=FP8_CVT if features else 0)
    # With the features: an fp8 (e4m3) cache with its float32 scales, and float32 sinks.
    fp8 = dict(k_cache_ptr="*fp8e4nv", k_scale_ptr="*fp32", v_scale_ptr="*fp32",
               sinks_ptr="*fp32") if features else {}
    triton.compile(ASTSource(balanced_decode_kernel, sig(balanced_decode_kernel, c, **fp8), c),
                   target=target, options={"num_warps": 4, "num_stages": 3})
    print("ok decode", heads_first, rr, features, flush=True)
c = dict(HEAD_SIZE=128, HEAD_PAD=128, SEG_CHUNK=16)
triton.compile(ASTSource(balanced_merge_kernel, sig(balanced_merge_kernel, c), c),
               target=target, options={"num_warps": 4})
print("ok merge", flush=True)
"""


def test_balanced_kernels_compile_for_sm90(tmp_path: Path) -> None:
    stdout = compile_script_for_sm90(_SCRIPT, tmp_path)
    assert stdout.count("ok ") == 9, stdout
