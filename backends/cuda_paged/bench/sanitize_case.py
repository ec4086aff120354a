"""A small mixed step for compute-sanitizer (memcheck / racecheck): every kernel once.

    compute-sanitizer --tool memcheck python backends/cuda_paged/bench/sanitize_case.py
        [--defaults | --prefill-only [--default-only]]

`--defaults`: only the shipped kernels as the planner picks them (MMA decode with its default
unroll, one pass and partitioned + reduce, the DEFAULT_PREFILL_KERNEL prefill, the cache
write), on small mixed steps of fp16 / bf16, head sizes 128 / 64 and block sizes 16 / 32
(GQA 4, decodes, prefills and chunked prefills over a prefix; a window and ALiBi once): the
racecheck-sized case of the issue.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_gpu import LONG, PIPES, STAGED, run_case
from pagedcore_cuda_paged.plan import (
    DEFAULT_PREFILL_KERNEL,
    DecodeKernel,
    DecodePass,
    PrefillKernel,
)

MMA, CLASSIC = DecodeKernel.MMA, DecodeKernel.CLASSIC
errs = []
CONFIGS = ((torch.float16, 16, 64), (torch.bfloat16, 8, 80), (torch.float32, 32, 64))
VARIANTS = ((MMA, True, PrefillKernel.MMA, 1), (MMA, True, PrefillKernel.MMA, 2),
            (MMA, True, PrefillKernel.MMA_128, 3),
            (CLASSIC, True, PrefillKernel.WMMA, 1), (CLASSIC, False, PrefillKernel.WMMA, 1))
# `--prefill-only`: just the multi-stage prefill kernels (a quicker racecheck of their
# one-barrier-per-tile ring).
# `--default-only`: of those, just the shipped default (racecheck is slow).
PREFILL_ONLY = "--prefill-only" in sys.argv
DEFAULT_ONLY = "--default-only" in sys.argv
DEFAULTS = "--defaults" in sys.argv
if DEFAULTS:
    print("shipped defaults: prefill", DEFAULT_PREFILL_KERNEL.value, flush=True)
    for (dtype, head, block, window, alibi), force in itertools.product(
            ((torch.float16, 128, 16, None, False), (torch.bfloat16, 64, 32, 50, True)),
            (DecodePass.ONE_PASS, DecodePass.PARTITIONED)):
        # REQUESTS: decodes at block edges (context up to 300: several partitions of 64
        # tokens), prompts of 70 and 130 tokens (two 128-row tiles, the causal diagonal inside
        # one), chunks over prefixes.
        errs.append(run_case(dtype, head, block, 2, 4, window=window, alibi=alibi, cap=None,
                             force=force, seed=7, partition_size=64, unroll=None))
if not PREFILL_ONLY and not DEFAULTS:
    for dtype, block, head in CONFIGS:
        for force in (DecodePass.ONE_PASS, DecodePass.PARTITIONED):
            for kernel, grouped, prefill, unroll in VARIANTS:
                if dtype == torch.float32 and kernel is MMA:
                    continue
                errs.append(run_case(dtype, head, block, 2, 4, window=37, alibi=True, cap=None,
                                     force=force, seed=1, group_heads=grouped, kernel=kernel,
                                     prefill=prefill, unroll=unroll))
    # Long chunks (several key tiles, double buffering) and a 16-head group through MMA.
    errs.append(run_case(torch.bfloat16, 128, 16, 2, 4, window=None, alibi=False, cap=None,
                         force=None, seed=2, reqs=LONG, partition_size=256))
    errs.append(run_case(torch.float16, 64, 32, 1, 16, window=100, alibi=True, cap=None,
                         force=DecodePass.PARTITIONED, seed=3, reqs=LONG, partition_size=128))
    errs.append(run_case(torch.bfloat16, 80, 8, 2, 2, window=90, alibi=False, cap=5.0,
                         force=None, seed=4, reqs=LONG, prefill=PrefillKernel.MMA_128))
for prefill in PIPES:
    if PREFILL_ONLY or DEFAULTS:
        continue
    errs.append(run_case(torch.float16, 80, 16, 2, 2, window=90, alibi=True, cap=None,
                         force=None, seed=5, reqs=LONG, prefill=prefill))
for prefill in STAGED:
    if DEFAULTS or (DEFAULT_ONLY and prefill is not DEFAULT_PREFILL_KERNEL):
        continue
    errs.append(run_case(torch.bfloat16, 128, 32, 2, 4, window=None, alibi=False, cap=None,
                         force=None, seed=6, reqs=LONG, prefill=prefill))
torch.cuda.synchronize()
print("sanitize case rel errors:", errs)
bad = [e for e in errs if not e <= 2e-2]
sys.exit(1 if bad else 0)
