"""Where and how the engine runs: device, dtype, default KV-cache budget."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["default_kv_cache_bytes", "resolve_device", "resolve_dtype"]

_CPU_KV_BYTES = 64 * 2**20


def resolve_device(device: Any) -> torch.device:
    """`device` as a torch.device; None means CUDA when available, else the CPU (see
    `pagedcore.engine.arguments.check_device` for the errors)."""
    from pagedcore.engine.arguments import check_device

    return check_device(device)


def resolve_dtype(dtype: Any, device: torch.device) -> torch.dtype:
    """A torch dtype from a dtype, a name or an alias; None / "auto" means bfloat16 on CUDA and
    float32 on the CPU."""
    import torch

    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
               "float": "float32"}
    name = aliases.get(str(dtype), str(dtype))
    resolved = getattr(torch, name, None)
    if name not in ("bfloat16", "float16", "float32") or not isinstance(resolved, torch.dtype):
        raise ValueError(
            f"invalid LLM argument: dtype={dtype!r} is not one of 'bfloat16', 'float16', "
            "'float32' (or a torch dtype of those); pass one of them, or None / 'auto' for the "
            "device's default"
        )
    return resolved


def default_kv_cache_bytes(device: torch.device, config: Any, utilization: float) -> int:
    """KV-cache bytes when the user gives none: 64 MiB on CPU; on CUDA `utilization` of the
    device minus what is in use and an activation reserve."""
    import torch

    if device.type != "cuda":
        return _CPU_KV_BYTES
    free, total = torch.cuda.mem_get_info(device)
    # Activations of the largest step: logits rows and a few hidden-size buffers per token.
    reserve = 2 * 2**30 + 16 * 2048 * int(config.hidden_size) * 4
    budget = int(total * utilization) - (total - free) - reserve
    if budget <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache ({free / 2**30:.1f} GiB free of "
            f"{total / 2**30:.1f} GiB at gpu_memory_utilization={utilization}); raise "
            "gpu_memory_utilization or pass kv_cache_memory_bytes"
        )
    return budget
