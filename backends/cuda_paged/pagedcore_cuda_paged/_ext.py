"""Loading the compiled kernels, and saying why they cannot run when they cannot.

The extension is built at install time (``setup.py``). Where it is missing but torch has CUDA,
``PAGEDCORE_CUDA_PAGED_JIT=1`` compiles ``csrc/`` on first use with
`torch.utils.cpp_extension.load` (minutes; cached in torch's extension directory). The sources
are looked up in ``PAGEDCORE_CSRC`` or the repository checkout this package sits in.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from pathlib import Path
from types import ModuleType

__all__ = ["JIT_ENV", "csrc_dir", "load_ops", "unavailable_reason"]

#: Set to "1" to compile csrc/ on first use when the installed extension is missing.
JIT_ENV = "PAGEDCORE_CUDA_PAGED_JIT"
_EXT = "pagedcore_cuda_paged._C"
_NO_EXT = "pagedcore-cuda-paged was installed without its compiled extension"


def csrc_dir() -> Path | None:
    """Where the CUDA sources are: ``$PAGEDCORE_CSRC`` or ``<checkout>/csrc``; None if absent."""
    env = os.environ.get("PAGEDCORE_CSRC")
    candidates = [Path(env)] if env else []
    candidates.append(Path(__file__).resolve().parents[3] / "csrc")
    for path in candidates:
        if (path / "ops.cpp").is_file():
            return path
    return None


def _has_compiled_extension() -> bool:
    try:
        return importlib.util.find_spec(_EXT) is not None
    except (ImportError, ValueError):
        return False


def unavailable_reason() -> str | None:
    """None when the kernels can run here, else why not (checked cheapest first)."""
    import torch

    if torch.version.cuda is None:
        return f"{_NO_EXT}: torch has no CUDA" if not _has_compiled_extension() else (
            "torch has no CUDA"
        )
    if not torch.cuda.is_available():
        return "no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        return f"needs compute capability >= 8.0 (found {major}.{minor})"
    if not _has_compiled_extension():
        if os.environ.get(JIT_ENV) == "1":
            if csrc_dir() is None:
                return f"{_NO_EXT}, and {JIT_ENV}=1 cannot find csrc/ (set PAGEDCORE_CSRC)"
            return None
        return (
            f"{_NO_EXT} (nvcc was not found at install time); reinstall with nvcc on PATH, "
            f"or set {JIT_ENV}=1 to compile csrc/ on first use"
        )
    return None


@functools.cache
def load_ops() -> ModuleType:
    """The kernel module (``cache_write``, ``decode``, ``prefill``); raises if unavailable."""
    why = unavailable_reason()
    if why is not None:
        raise RuntimeError(f"cuda_paged cannot run here: {why}")
    if _has_compiled_extension():
        return importlib.import_module(_EXT)
    return _jit_build()


def _jit_build() -> ModuleType:
    from torch.utils.cpp_extension import load

    src = csrc_dir()
    assert src is not None  # unavailable_reason() checked it
    sources = [str(p) for p in sorted(src.glob("*.cu"))] + [str(src / "ops.cpp")]
    module: ModuleType = load(
        name="pagedcore_cuda_paged_jit",
        sources=sources,
        extra_include_paths=[str(src)],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3", "-lineinfo"],
        verbose=False,
    )
    return module
