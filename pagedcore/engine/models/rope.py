"""Rotary embeddings whose frequencies transformers switches at run time, pinned for a batch.

transformers' ``longrope`` (Phi-3 / Phi-3.5 with 128K contexts) picks its frequencies per
forward call: the long factors when the call's largest position id passes
``original_max_position_embeddings``, else the short ones. An engine runs every request of a
step in one call and a long prompt in chunks, so that choice would depend on the other
requests of the step (a short request batched with a long one got the long factors) and on
where a prompt was cut into chunks (early chunks short, later ones long, in one KV cache).

`pin_longrope` fixes the choice once per model from ``max_model_len``, as vLLM does: the long
factors when the engine may run sequences past the original length, else the short ones.
Every step then rotates every token alike. With ``max_model_len`` at or below the original
length this is exactly transformers' choice for every sequence; above it, sequences shorter
than the original length get the long factors (transformers would give them the short ones,
and switch a growing sequence's earlier tokens too, which no KV cache can follow).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["pin_longrope"]


def _original_max_positions(module: nn.Module) -> int | None:
    config: Any = getattr(module, "config", None)
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params.get("original_max_position_embeddings"):
        return int(params["original_max_position_embeddings"])
    value = getattr(config, "original_max_position_embeddings", None)
    return None if value is None else int(value)


def pin_longrope(model: nn.Module, max_model_len: int) -> dict[str, str]:
    """Fix the frequencies of every ``longrope`` rotary module of `model` (see the module
    doc); ``{module name: "long" | "short"}`` for those it pinned.

    The module's own update still runs each call, but chooses between two copies of the
    pinned frequencies, so it cannot switch them.
    """
    pinned: dict[str, str] = {}
    for name, module in model.named_modules():
        if getattr(module, "rope_type", None) != "longrope":
            continue
        original = _original_max_positions(module)
        short = getattr(module, "original_inv_freq", None)
        inv_freq = getattr(module, "inv_freq", None)
        if original is None or not isinstance(short, torch.Tensor) \
                or not isinstance(inv_freq, torch.Tensor):
            continue  # not transformers' layout: nothing known to pin
        use_long = max_model_len > original
        if use_long:
            # The module's own switch, once, at a position past the original length.
            probe = torch.zeros(1, 1, 1, dtype=torch.float32, device=inv_freq.device)
            with torch.no_grad():
                module(probe, torch.full((1, 1), original, dtype=torch.long,
                                         device=inv_freq.device))
            chosen = inv_freq.detach().clone()
        else:
            chosen = short.detach().clone().to(inv_freq.device)
        module.original_inv_freq = chosen
        module.long_inv_freq = chosen.clone()
        with torch.no_grad():
            inv_freq.copy_(chosen)
        pinned[name] = "long" if use_long else "short"
    return pinned
