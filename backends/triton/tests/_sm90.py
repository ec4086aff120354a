"""Compile Triton kernels for sm_90 (H100/H200) without a GPU: Triton's front end and its
bundled ptxas, in a subprocess without ``TRITON_INTERPRET`` (which the tests' conftest sets
on CPU machines)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def compile_script_for_sm90(script: str, cache_dir: Path) -> str:
    """Run `script` (which calls ``triton.compile`` for ``GPUTarget("cuda", 90, 32)``) in a
    subprocess with its own Triton cache; its stdout. Skips the test when Triton has no ptxas
    here; fails with the script's output when it fails."""
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip(f"triton's bundled ptxas is not at {ptxas}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout
