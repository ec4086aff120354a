"""Fused rotary embedding and QKV projection for Llama / Qwen2 attention (Triton, CUDA).

transformers' ``apply_rotary_pos_emb`` runs as ten small kernels per layer (four muls, two
negations, two concatenations, two adds) and the three projections as three GEMMs; in a
decode step these are launch-bound. `FusedAttention` replaces a `LlamaAttention` /
`Qwen2Attention` module: one GEMM over the q, k and v weights stacked in one buffer (the
modules keep their parameters, which become views into it: same state-dict keys, same
memory), and one `rotary_kernel` launch for the query and key heads. The attention function
is dispatched as transformers dispatches it (``config._attn_implementation``).

Numbers: the rotary kernel rounds where torch's separate ops round, so the rotated q/k are
bit-identical to transformers'. The stacked GEMM is one cuBLAS call of another shape than
the three it replaces, so its bf16 rounding may differ in the last bit (a batch-shape
effect of the same kind as any other); ``PAGEDCORE_FUSED_KERNELS`` can leave it out.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pagedcore.engine.models.attention_hook import ATTN_IMPLEMENTATION, paged_attention_tokens
from pagedcore.engine.models.fused_ops import copy_attributes
from pagedcore.engine.models.linear_stack import LinearStack

__all__ = ["ATTENTION_CLASSES", "FusedAttention", "apply_rotary", "swap_fused_attention"]

#: Attention classes with plain q/k/v/o projections and full-head-dim rotary, replaced by
#: `FusedAttention` (Qwen3's q/k norms and Mistral's config-level window are not handled).
ATTENTION_CLASSES = ("LlamaAttention", "Qwen2Attention")
_MAX_HEAD_DIM = 1024


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                 first_heads: int, second_heads: int | None = None,
                 ) -> tuple[torch.Tensor, ...]:
    """``x * cos + rotate_half(x) * sin`` per head, split into contiguous outputs.

    Parameters
    ----------
    x:
        ``[T, H, D]`` fp32 / fp16 / bf16 on CUDA (or CPU under ``TRITON_INTERPRET=1``); heads
        ``D`` apart and contiguous within a head, any token stride (e.g. a fused QKV output).
    cos, sin:
        ``[T, D]`` or ``[1, T, D]``, `x`'s dtype (what transformers' rotary module returns).
    first_heads:
        Heads ``[0, first_heads)`` form the first output (the query heads).
    second_heads:
        The next heads, rotated too, form the second output (the key heads); the heads
        after them (the value heads) are copied unrotated into a third. None: every head
        after the first is a key head (two outputs).

    Returns
    -------
    tuple
        ``([T, first_heads, D], [T, second_heads, D])``, plus ``[T, rest, D]`` when heads
        are left after them; contiguous, `x`'s dtype.
    """
    from pagedcore.engine.models import _fused_kernels as kernels

    tokens, heads, dim = x.shape
    second = heads - first_heads if second_heads is None else second_heads
    cos = cos.reshape(-1, dim)
    sin = sin.reshape(-1, dim)
    if cos.shape[0] != tokens or sin.shape != cos.shape:
        raise ValueError(f"apply_rotary: cos {tuple(cos.shape)} / sin {tuple(sin.shape)} do not "
                         f"match x {tuple(x.shape)}; pass one [D] row per token")
    if dim % 2 or not 0 < dim <= _MAX_HEAD_DIM or not (
            0 <= first_heads and 0 <= second and first_heads + second <= heads):
        raise ValueError(f"apply_rotary: head size {dim} must be even and at most "
                         f"{_MAX_HEAD_DIM}, first_heads {first_heads} + second_heads {second} "
                         f"within the {heads} heads")
    if x.stride(2) != 1 or x.stride(1) != dim:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    if cos.dtype != x.dtype or sin.dtype != x.dtype:
        raise ValueError(f"apply_rotary: cos/sin are {cos.dtype}/{sin.dtype}, x is {x.dtype}; "
                         "cast them to x's dtype (transformers does)")
    out = torch.empty(tokens * heads * dim, dtype=x.dtype, device=x.device)
    sizes = [first_heads, second] + ([heads - first_heads - second]
                                     if heads > first_heads + second else [])
    parts = []
    offset = 0
    for h in sizes:
        parts.append(out[offset:offset + tokens * h * dim].view(tokens, h, dim))
        offset += tokens * h * dim
    if tokens and heads:
        half = dim // 2
        kernels.rotary_kernel[(tokens, heads)](
            x, cos, sin, out, x.stride(0), cos.stride(0), tokens, first_heads, second,
            HEAD_DIM=dim, HALF=half, BLOCK=1 << (half - 1).bit_length(),
            ROUND=x.dtype != torch.float32, num_warps=1 if dim <= 128 else 2,
            enable_fp_fusion=False,
        )
    return tuple(parts)


class FusedAttention(nn.Module):
    """A Llama / Qwen2 attention module with one QKV GEMM and one rotary launch.

    Parameters
    ----------
    orig:
        One of `ATTENTION_CLASSES`; its projections are reused (possibly tensor-parallel
        shards: then q, k and v stay three GEMMs) and its attributes copied.
    fuse_qkv:
        Stack the q/k/v weights for one GEMM (when they are plain `nn.Linear`s).
    """

    def __init__(self, orig: nn.Module, *, fuse_qkv: bool = True) -> None:
        super().__init__()
        src: Any = orig
        self.q_proj: nn.Module = src.q_proj
        self.k_proj: nn.Module = src.k_proj
        self.v_proj: nn.Module = src.v_proj
        self.o_proj: nn.Module = src.o_proj
        self.config: Any = src.config
        copy_attributes(self, orig, ("layer_idx", "head_dim", "num_key_value_groups", "scaling",
                                     "attention_dropout", "is_causal", "layer_type",
                                     "sliding_window"))
        self.head_dim: int = int(src.head_dim)
        #: Passed to the attention function by the classes that pass it (Qwen2).
        self._window_kw: dict[str, Any] = (
            {"sliding_window": src.sliding_window} if hasattr(src, "sliding_window") else {})
        self._eager: Callable[..., Any] = sys.modules[type(orig).__module__].eager_attention_forward
        #: The three projections as one GEMM (None: not stacked).
        self._qkv: LinearStack | None = (
            LinearStack.build([self.q_proj, self.k_proj, self.v_proj]) if fuse_qkv else None)

    @property
    def fused_qkv(self) -> bool:
        """Whether the three projections run as one GEMM: stacked, and their weights still
        views into the stack (a projection whose weight was replaced runs on its own)."""
        return self._qkv is not None and self._qkv.intact

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        """``[..., hidden]`` -> the ``[T, Hq + 2 Hkv, D]`` q, k and v heads side by side (a
        view of the one QKV GEMM's output when stacked), ``Hq`` and ``Hkv``."""
        d = self.head_dim
        stack = self._qkv
        if stack is not None and stack.intact:
            nq, nk, nv = stack.sizes
            qkv = stack(x).view(-1, (nq + nk + nv) // d, d)
            return qkv, nq // d, nk // d
        q = self.q_proj(x)
        k = self.k_proj(x)
        v = self.v_proj(x)
        tokens = v.numel() // v.shape[-1]
        qkv = torch.cat([q.view(tokens, -1, d), k.view(tokens, -1, d),
                         v.view(tokens, -1, d)], dim=1)
        return qkv, q.shape[-1] // d, k.shape[-1] // d

    def forward(self, hidden_states: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                attention_mask: torch.Tensor | None = None, **kwargs: Any,
                ) -> tuple[torch.Tensor, Any]:
        """``[B, T, hidden]`` -> (``[B, T, hidden]``, attention weights or None)."""
        if position_embeddings is None:
            raise ValueError("FusedAttention needs position_embeddings (cos, sin) from the "
                             "model's rotary module, as transformers passes them")
        kwargs.pop("cache", None)
        kwargs.pop("past_key_values", None)
        input_shape = hidden_states.shape[:-1]
        qkv, num_q_heads, num_kv_heads = self._project(hidden_states)
        batch = input_shape[0] if len(input_shape) > 1 else 1
        tokens = qkv.shape[0] // batch
        cos, sin = position_embeddings
        if cos.dim() == 3 and cos.shape[0] != batch:  # one row of positions for the batch
            cos = cos.expand(batch, -1, -1)
            sin = sin.expand(batch, -1, -1)
        # The v heads are copied into their own contiguous buffer in the same launch.
        q, k, v = apply_rotary(qkv, cos, sin, first_heads=num_q_heads,
                               second_heads=num_kv_heads)
        if batch == 1 and self.config._attn_implementation == ATTN_IMPLEMENTATION:
            # The engine's layout: the heads are already token-major [T, H, D], as the paged
            # backends take them; no [1, H, T, D] views, interface lookup or copies back.
            out_tokens = paged_attention_tokens(
                self, q, k, v, pagedcore_ctx=kwargs.get("pagedcore_ctx"),
                sliding_window=self._window_kw.get("sliding_window"))
            return self.o_proj(out_tokens.view(*input_shape, -1)), None

        def heads_first(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, tokens, t.shape[1], t.shape[2]).transpose(1, 2)

        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        attention: Callable[..., Any] = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, self._eager)
        out, weights = attention(
            self, heads_first(q), heads_first(k), heads_first(v), attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling, **self._window_kw, **kwargs,
        )
        out = out.reshape(*input_shape, -1).contiguous()
        return self.o_proj(out), weights


def swap_fused_attention(model: nn.Module, *, fuse_qkv: bool = True) -> dict[str, int]:
    """Replace `model`'s `ATTENTION_CLASSES` modules by `FusedAttention`.

    Parameters
    ----------
    model:
        A transformers model on its device, in its dtype (already sharded when
        tensor-parallel). Other attention classes are left alone.
    fuse_qkv:
        Also stack each layer's q/k/v weights for one GEMM.

    Returns
    -------
    dict[str, int]
        ``{"rotary": n, "qkv": m}``: modules replaced, and those running one QKV GEMM.
    """
    counts = {"rotary": 0, "qkv": 0}
    targets = [(name, module) for name, module in model.named_modules()
               if name and type(module).__name__ in ATTENTION_CLASSES
               and int(getattr(module, "head_dim", 0)) % 2 == 0
               and hasattr(sys.modules[type(module).__module__], "eager_attention_forward")]
    for name, module in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        new = FusedAttention(module, fuse_qkv=fuse_qkv)
        setattr(parent, attr, new)
        counts["rotary"] += 1
        counts["qkv"] += int(new.fused_qkv)
    return counts
