"""A Llama-family decoder layer whose first residual add runs inside the norm after it.

transformers' decoder layer computes ``h = x + attn(norm1(x))``, then ``norm2(h)``: two
launches (the add, the norm) and one extra round trip of ``h`` through memory. `FusedDecoderLayer`
computes both with `pagedcore.engine.models.fused_ops.add_rms_norm` (one launch, the same
rounding: the sum is rounded to the activation dtype before it is normalised, as torch's add
rounds it). It wraps the original's submodules (same state-dict keys) and passes every
keyword argument through to the attention module as transformers' layer does. With
``down_add`` (an opt-in fused kind) the second residual add, ``h + mlp(norm2(h))``, runs
inside the MLP's down projection as well (`FusedSiLUMulMLP.add_into`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedcore.engine.models.fused_ops import copy_attributes

__all__ = ["DECODER_LAYER_CLASSES", "FusedDecoderLayer", "swap_fused_decoder_layers"]

#: Decoder layers computing ``x + attn(norm1(x))``, then ``h + mlp(norm2(h))``.
DECODER_LAYER_CLASSES = ("LlamaDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer",
                         "MistralDecoderLayer")
_NORM_CLASSES = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm",
                 "FusedRMSNorm")


class FusedDecoderLayer(nn.Module):
    """One of `DECODER_LAYER_CLASSES` with its first residual add fused into ``norm2``.

    Parameters
    ----------
    orig:
        The layer; its ``self_attn``, ``mlp``, ``input_layernorm`` and
        ``post_attention_layernorm`` (an RMSNorm with ``weight`` and ``variance_epsilon``)
        are reused as they are.
    """

    def __init__(self, orig: nn.Module, *, down_add: bool = False) -> None:
        super().__init__()
        src: Any = orig
        self.self_attn: nn.Module = src.self_attn
        self.mlp: nn.Module = src.mlp
        self.input_layernorm: nn.Module = src.input_layernorm
        self.post_attention_layernorm: nn.Module = src.post_attention_layernorm
        copy_attributes(self, orig, ("hidden_size", "attention_type", "layer_idx"))
        #: The second residual add runs inside the MLP's down projection
        #: (`FusedSiLUMulMLP.add_into`; the ``down_add`` fused kind).
        self.down_add = down_add and hasattr(self.mlp, "add_into")

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``[B, T, hidden]`` -> ``[B, T, hidden]`` (keyword arguments as transformers'
        layer takes them; they reach the attention module unchanged)."""
        from pagedcore.engine.models.fused_ops import add_rms_norm

        if args:
            raise TypeError("FusedDecoderLayer takes the hidden states positionally and "
                            "everything else by keyword, as transformers' models call it")
        residual = hidden_states
        attn_out, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states),
                                     **kwargs)
        norm: Any = self.post_attention_layernorm
        normed, hidden = add_rms_norm(attn_out, residual, norm.weight,
                                      eps=float(norm.variance_epsilon))
        if self.down_add:  # (`hidden` is add_rms_norm's fresh tensor: ours to overwrite)
            mlp: Any = self.mlp
            into: torch.Tensor = mlp.add_into(normed, hidden)
            return into
        out: torch.Tensor = hidden + self.mlp(normed)
        return out


def swap_fused_decoder_layers(model: nn.Module, *, down_add: bool = False) -> int:
    """Replace `model`'s `DECODER_LAYER_CLASSES` layers by `FusedDecoderLayer` (with
    `down_add`: those whose MLP is a `FusedSiLUMulMLP` add its output into the residual
    inside the down projection); returns how many. Layers whose post-attention norm is not a
    plain RMSNorm are left alone."""
    count = 0
    targets = [(name, module) for name, module in model.named_modules()
               if name and type(module).__name__ in DECODER_LAYER_CLASSES
               and type(getattr(module, "post_attention_layernorm", None)).__name__
               in _NORM_CLASSES]
    for name, module in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, FusedDecoderLayer(module, down_add=down_add))
        count += 1
    return count
