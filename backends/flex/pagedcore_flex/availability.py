"""Whether this torch has FlexAttention (checked at call time, without importing CUDA)."""

from __future__ import annotations

import importlib.util

__all__ = ["MIN_TORCH", "availability_problem"]

#: First torch release with ``torch.nn.attention.flex_attention`` and ``enable_gqa``.
MIN_TORCH = (2, 5)


def _version_tuple(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def availability_problem() -> str | None:
    """None when FlexAttention can be imported, else why not and what to do."""
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed; install torch>=2.5"
    import torch

    found = _version_tuple(torch.__version__)
    if found < MIN_TORCH:
        return (
            f"torch {torch.__version__} is too old: FlexAttention needs torch>="
            f"{MIN_TORCH[0]}.{MIN_TORCH[1]}; upgrade torch or choose another backend"
        )
    try:
        importlib.import_module("torch.nn.attention.flex_attention")
    except ImportError as exc:
        return f"torch.nn.attention.flex_attention cannot be imported ({exc})"
    return None
