"""Shared helpers of the experiment benches: what ran where, JSON writing, plots, percentiles.

Every experiment report (`pagedcore bench prefix|chunked|memory|backends`) starts with the same
``"environment"`` block (device, torch/transformers versions, git commit, command line) and a
``"model"`` block (shape, dtype, KV dtype), so a number in the docs can always be traced to the
code, the machine and the configuration that produced it. matplotlib is imported lazily and
always with the non-interactive Agg backend.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from matplotlib.figure import Figure

__all__ = [
    "BENCH_MODELS",
    "bench_model_config",
    "build_bench_model",
    "device_memory",
    "engine_bench_model",
    "environment",
    "git_commit",
    "model_shape",
    "percentiles",
    "pick_device",
    "save_figure",
    "subplots",
    "write_json",
]


def git_commit() -> str | None:
    """``HEAD`` of the checkout this module lives in, with ``+dirty`` when the tree has
    uncommitted changes; outside a git checkout (a copy of the tree sent to a GPU machine) the
    ``PAGEDCORE_GIT_COMMIT`` environment variable, else None."""
    if "PAGEDCORE_GIT_COMMIT" in os.environ:
        return os.environ["PAGEDCORE_GIT_COMMIT"]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    suffix = "+dirty" if dirty.returncode == 0 and dirty.stdout.strip() else ""
    return head.stdout.strip() + suffix


def pick_device(device: str | None) -> torch.device:
    """`device`, or CUDA when available, else CPU; on CPU torch is set to one intra-op thread
    (fastest for the tiny models of ``--small``, and least disturbed by other processes)."""
    import torch

    picked = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if picked.type == "cpu":
        torch.set_num_threads(1)
    return picked


#: The model shapes of the engine experiments (``--model``), the default first.
BENCH_MODELS = ("qwen2-0.5b", "llama3-8b")


def bench_model_config(model: str, *, small: bool = False,
                       max_position_embeddings: int | None = None) -> Any:
    """The transformers config of a `BENCH_MODELS` shape.

    ``small``: a tiny 2-layer model of the same architecture (hidden 128) for CPUs:
    Qwen2 for ``qwen2-0.5b``, Llama with 4 query / 1 KV heads of 32 for ``llama3-8b``.
    `max_position_embeddings` overrides the position limit (None: the shape's own, 32,768
    for the tiny ones).

    Raises
    ------
    ValueError
        `model` is not one of `BENCH_MODELS`.
    """
    from pagedcore.engine.models.loading import llama3_8b_config, qwen2_0_5b_config, tiny_config

    if model not in BENCH_MODELS:
        raise ValueError(f"unknown benchmark model {model!r}; choose one of {BENCH_MODELS}")
    pos: dict[str, Any] = {}
    if max_position_embeddings is not None:
        pos["max_position_embeddings"] = max_position_embeddings
    if small:
        tiny: dict[str, Any] = dict(vocab_size=512, hidden_size=128, intermediate_size=256,
                                    num_hidden_layers=2, max_position_embeddings=32768)
        if model == "llama3-8b":
            tiny.update(num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                        intermediate_size=448, rope_theta=500000.0)
            return tiny_config("llama", **{**tiny, **pos})
        return tiny_config("qwen2", **{**tiny, **pos})
    if model == "llama3-8b":
        return llama3_8b_config(**pos)
    return qwen2_0_5b_config(**pos)


def engine_bench_model(small: bool, device: str | None, model: str = "qwen2-0.5b", *,
                       max_position_embeddings: int | None = None,
                       ) -> tuple[torch.device, torch.dtype, Any]:
    """The engine experiments' device, dtype and model config.

    Parameters
    ----------
    small:
        A tiny 2-layer model of `model`'s architecture (hidden 128) in float32, for CPUs.
    device:
        ``"cpu"``, ``"cuda"`` or None (CUDA when available).
    model:
        One of `BENCH_MODELS`: ``"qwen2-0.5b"`` (the default: 24 layers, hidden 896) or
        ``"llama3-8b"`` (32 layers, hidden 4096, 32/8 heads of 128: 16 GB of bf16 weights,
        built with seeded random weights directly on the device).
    max_position_embeddings:
        Override of the config's position limit (None: keep it).

    Returns
    -------
    tuple
        ``(device, dtype, config)``; bf16 on CUDA, float32 on CPU.
    """
    import torch

    config = bench_model_config(model, small=small,
                                max_position_embeddings=max_position_embeddings)
    dev = pick_device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    return dev, dtype, config


def build_bench_model(config: Any, *, dtype: torch.dtype, device: torch.device,
                      seed: int = 0) -> tuple[Any, float]:
    """`pagedcore.engine.models.loading.random_model` on `device`, and the seconds it took (synced):
    the weights are created and initialised on the device, never on the host."""
    import time

    import torch

    from pagedcore.engine.models.loading import random_model

    t0 = time.perf_counter()
    model = random_model(config, dtype=dtype, device=device, seed=seed)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return model, time.perf_counter() - t0


def environment(device: torch.device) -> dict[str, Any]:
    """Device name, library versions, commit and command line of this run."""
    import torch
    import transformers

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"cpu ({platform.processor() or platform.machine()}, "
        name += f"{torch.get_num_threads()} torch threads)"
    return {
        "device": name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "git_commit": git_commit(),
        "load_average_1_5_15min": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "command": " ".join(["pagedcore", *sys.argv[1:]]) if sys.argv else None,
    }


def device_memory(device: torch.device) -> dict[str, float] | None:
    """Peak CUDA memory of this process so far (GiB: allocated, reserved by the caching
    allocator, and the device's total); None off CUDA."""
    import torch

    if device.type != "cuda":
        return None
    gib = float(1 << 30)
    return {"max_allocated_gib": torch.cuda.max_memory_allocated(device) / gib,
            "max_reserved_gib": torch.cuda.max_memory_reserved(device) / gib,
            "total_gib": torch.cuda.get_device_properties(device).total_memory / gib}


def model_shape(config: Any, *, dtype: torch.dtype, kv_dtype: torch.dtype,
                name: str | None = None) -> dict[str, Any]:
    """The attention-relevant shape of a transformers config, with weight and KV dtypes and
    (when given) the benchmark model `name` it was built from."""
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
    shape: dict[str, Any] = {} if name is None else {"name": name}
    return {
        **shape,
        "model_type": config.model_type,
        "num_hidden_layers": int(config.num_hidden_layers),
        "hidden_size": int(config.hidden_size),
        "num_attention_heads": heads,
        "num_key_value_heads": int(getattr(config, "num_key_value_heads", heads)),
        "head_dim": int(head_dim),
        "vocab_size": int(config.vocab_size),
        "intermediate_size": getattr(config, "intermediate_size", None),
        "num_parameters_approx": _approx_params(config),
        "weights": "random (seeded)",
        "dtype": str(dtype).removeprefix("torch."),
        "kv_dtype": str(kv_dtype).removeprefix("torch."),
    }


def _approx_params(config: Any) -> int | None:
    """Parameters of a dense decoder config (attention, gated MLP, embeddings), None when
    its fields are not all there (e.g. MLA)."""
    try:
        h, layers = int(config.hidden_size), int(config.num_hidden_layers)
        heads = int(config.num_attention_heads)
        kv = int(getattr(config, "num_key_value_heads", heads))
        d = int(getattr(config, "head_dim", None) or h // heads)
        inter, vocab = int(config.intermediate_size), int(config.vocab_size)
    except (AttributeError, TypeError):
        return None
    embed = vocab * h * (1 if getattr(config, "tie_word_embeddings", False) else 2)
    return layers * (h * d * (2 * heads + 2 * kv) + 3 * h * inter) + embed


def percentiles(values: Sequence[float], qs: Sequence[int] = (50, 95, 99)) -> dict[str, Any]:
    """``{"p50": ..., "p95": ..., "p99": ..., "n": len}`` by linear interpolation between
    order statistics (numpy's default); None for each percentile of an empty input."""
    data = sorted(float(v) for v in values)
    out: dict[str, Any] = {"n": len(data)}
    for q in qs:
        if not data:
            out[f"p{q}"] = None
            continue
        pos = (len(data) - 1) * q / 100
        lo, hi = math.floor(pos), math.ceil(pos)
        out[f"p{q}"] = data[lo] + (data[hi] - data[lo]) * (pos - lo)
    return out


def write_json(path: str, report: dict[str, Any]) -> None:
    """Write `report` as indented JSON, creating the parent directory."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    with open(path, "w") as fh:
        json.dump(report, fh, indent=2, default=str)
        fh.write("\n")


def subplots(ncols: int, *, width: float = 5.5, height: float = 4.0) -> tuple[Figure, Any]:
    """A one-row figure of `ncols` axes on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, axes[0]


def save_figure(fig: Figure, path: str, *, caption: str | None = None) -> None:
    """Save `fig` as PNG at `path` (parent created) with an optional small caption, and close it."""
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if caption:
        fig.text(0.01, 0.005, caption, fontsize=7, color="0.35", ha="left", va="bottom")
    fig.tight_layout(rect=(0, 0.04 if caption else 0, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
