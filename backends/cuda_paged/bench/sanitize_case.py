"""A small mixed step for compute-sanitizer (memcheck / racecheck): every kernel once.

    compute-sanitizer --tool memcheck python backends/cuda_paged/bench/sanitize_case.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_gpu import run_case
from pagedcore_cuda_paged.plan import DecodePass

errs = []
CONFIGS = ((torch.float16, 16, 64), (torch.bfloat16, 8, 80), (torch.float32, 32, 64))
for dtype, block, head in CONFIGS:
    for force in (DecodePass.ONE_PASS, DecodePass.PARTITIONED):
        for grouped in (True, False):
            errs.append(run_case(dtype, head, block, 2, 4, window=37, alibi=True, cap=None,
                                 force=force, seed=1, group_heads=grouped))
torch.cuda.synchronize()
print("sanitize case rel errors:", errs)
