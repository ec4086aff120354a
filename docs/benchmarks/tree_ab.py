"""Interleaved A/B runs of source trees for the CPU host benchmarks (`host_step_cpu.py`,
`prefix_hit_cpu.py`): each round runs the calling script once under every tree (its root first
on ``PYTHONPATH``, from a scratch directory so the working directory shadows nothing), so the
load of a shared machine hits each tree alike; the caller pools the samples each run wrote."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["commit_of", "interleave", "medians"]


def commit_of(tree: str) -> str:
    """The short commit of the checkout at `tree` (or a note that it is none)."""
    out = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True, check=False).stdout.strip()
    return out or "not a git checkout"


def medians(samples: dict[str, list[float]]) -> dict[str, float]:
    """Each phase's median (us, one decimal); phases without samples are left out."""
    return {p: round(statistics.median(v), 1) for p, v in samples.items() if v}


def interleave(script: str, child_args: list[str], trees: list[str],
               rounds: int) -> Iterator[tuple[str, Any]]:
    """Run ``script child_args --samples OUT`` under each tree, `rounds` times in turn; yield
    ``(tree, the JSON the run wrote to OUT)``."""
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for i, tree in enumerate(trees):
                out = os.path.join(tmp, f"{r}-{i}.json")
                subprocess.run([sys.executable, script, *child_args, "--samples", out],
                               env=dict(os.environ, PYTHONPATH=tree), check=True, cwd=tmp)
                yield tree, json.loads(Path(out).read_text())
