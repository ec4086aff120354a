"""Build of pagedcore-cuda-paged: compiles ../../csrc into `pagedcore_cuda_paged._C` when torch
has CUDA and nvcc is found; otherwise installs the pure-Python part, which registers the
backend and reports through `is_available()` why it cannot run.

Environment:
    PAGEDCORE_CUDA_PAGED_NO_BUILD=1   skip the extension even where it could be built.
    PAGEDCORE_CUDA_PAGED_ARCHS=90     compute capabilities to build for, comma-separated
                                      (default "80,90"); PTX of the last one is embedded.
    MAX_JOBS=N                        parallel nvcc jobs (ninja), e.g. 16.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from setuptools import setup

HERE = Path(__file__).resolve().parent
CSRC = HERE.parent.parent / "csrc"

#: Default: sm_80 and sm_90 machine code plus compute_90 PTX for newer chips.
DEFAULT_ARCHS = "80,90"


def nvcc_arch_flags(archs: str) -> list[str]:
    """``-gencode`` flags for comma-separated compute capabilities ("80,90"), plus PTX of the
    last one so newer GPUs can JIT it."""
    caps = [a.strip() for a in archs.split(",") if a.strip()]
    if not caps or not all(a.isdecimal() for a in caps):
        raise SystemExit(f"PAGEDCORE_CUDA_PAGED_ARCHS must be like '80,90', got {archs!r}")
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in caps]
    return [*flags, f"-gencode=arch=compute_{caps[-1]},code=compute_{caps[-1]}"]


def _skip(reason: str) -> tuple[list[Any], dict[str, Any]]:
    print(f"pagedcore-cuda-paged: building without the compiled extension: {reason}",
          file=sys.stderr)
    return [], {}


def _extensions() -> tuple[list[Any], dict[str, Any]]:
    if os.environ.get("PAGEDCORE_CUDA_PAGED_NO_BUILD") == "1":
        return _skip("PAGEDCORE_CUDA_PAGED_NO_BUILD=1")
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        return _skip("torch is not importable at build time (use --no-build-isolation)")
    if torch.version.cuda is None:
        return _skip("torch has no CUDA")
    if CUDA_HOME is None:
        return _skip("nvcc / CUDA_HOME not found")
    if not CSRC.is_dir():
        return _skip(f"CUDA sources not found at {CSRC}")
    sources = [*sorted(CSRC.glob("*.cu")), CSRC / "ops.cpp"]
    ext = CUDAExtension(
        name="pagedcore_cuda_paged._C",
        sources=[os.path.relpath(s, HERE) for s in sources],
        include_dirs=[str(CSRC)],
        extra_compile_args={
            "cxx": ["-O3"],
            "nvcc": ["-O3", "-lineinfo", *nvcc_arch_flags(
                os.environ.get("PAGEDCORE_CUDA_PAGED_ARCHS", DEFAULT_ARCHS))],
        },
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
