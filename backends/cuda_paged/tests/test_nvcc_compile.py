"""CI compile check of csrc/: every .cu through nvcc's front end and NVVM to sm_90 PTX
(device code, every template instantiation; ptxas is skipped to keep CI fast), and the torch
bindings (ops.cpp) through the host compiler, when the tools are here.

This catches syntax and template errors without a GPU or a CUDA build of torch; it does not
link or run anything (that happens only on a GPU machine: bench/gpu_run.sh).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[3] / "csrc"
NVCC = shutil.which("nvcc")
CU_FILES = sorted(CSRC.glob("*.cu"))


def _torch_includes() -> list[str]:
    from torch.utils.cpp_extension import include_paths

    return [f"-I{p}" for p in include_paths()]


def _cuda_include() -> Path | None:
    nvcc_home = Path(NVCC).resolve().parents[1] if NVCC else None
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda", nvcc_home):
        if home and (Path(home) / "include" / "cuda_runtime_api.h").is_file():
            return Path(home) / "include"
    return None


def test_sources_present() -> None:
    assert (CSRC / "ops.cpp").is_file(), f"csrc/ not found at {CSRC}"
    names = {p.name for p in CU_FILES}
    for dtype in ("f16", "bf16", "f32"):
        assert f"decode_{dtype}.cu" in names and f"prefill_{dtype}.cu" in names


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("source", CU_FILES, ids=lambda p: p.name)
def test_cu_compiles_for_sm90(source: Path, tmp_path: Path) -> None:
    assert NVCC is not None
    cmd = [NVCC, "-ptx", "-std=c++17", "-O1", "-arch=compute_90", f"-I{CSRC}",
           *_torch_includes(), str(source), "-o", str(tmp_path / "out.ptx")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"nvcc failed on {source.name}:\n{proc.stderr[-4000:]}"


@pytest.mark.skipif(_cuda_include() is None, reason="no CUDA headers (CUDA_HOME unset)")
@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not on PATH")
def test_bindings_parse(tmp_path: Path) -> None:
    # CPU torch ships the c10/cuda headers but not the generated cuda_cmake_macros.h; an empty
    # stand-in is enough for a syntax check of ops.cpp.
    stub = tmp_path / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    cuda_include = _cuda_include()
    cmd = ["g++", "-std=c++20", "-fsyntax-only", "-w", "-DTORCH_EXTENSION_NAME=_C",
           *_torch_includes(), f"-I{tmp_path}", f"-I{cuda_include}", f"-I{CSRC}",
           f"-I{sysconfig.get_paths()['include']}", str(CSRC / "ops.cpp")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"ops.cpp does not compile:\n{proc.stderr[-4000:]}"
