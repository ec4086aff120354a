"""Megatron-style sharding of a transformers decoder across tensor-parallel ranks.

Per decoder layer, rank ``r`` of ``N`` keeps

- attention: query heads ``[r*Hq/N, (r+1)*Hq/N)`` and KV heads ``[r*Hkv/N, (r+1)*Hkv/N)``
  (column slices of ``q_proj``, ``k_proj``, ``v_proj``; GQA groups stay whole because both
  ranges are contiguous), and the matching input columns of ``o_proj``;
- MLP: rows ``[r*I/N, (r+1)*I/N)`` of ``gate_proj`` / ``up_proj`` and those columns of
  ``down_proj``.

``o_proj`` and ``down_proj`` become `RowParallelLinear`: each rank computes a partial sum, one
all-reduce adds them, then the bias is added once. Embeddings, norms and ``lm_head`` stay
replicated (only rank 0 computes logits). Two all-reduces per layer, as in Megatron-LM / vLLM.

Imported only on the tensor-parallel path, so torch is imported at module level.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "TP_MODEL_TYPES",
    "RowParallelLinear",
    "check_shardable",
    "rank_config",
    "shard_model",
]

#: Architectures whose attention / MLP modules `shard_model` knows.
TP_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "gemma2")


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _head_dim(config: Any) -> int:
    head_dim = getattr(config, "head_dim", None)
    return int(head_dim) if head_dim else int(config.hidden_size) // int(
        config.num_attention_heads
    )


def check_shardable(config: Any, world_size: int) -> None:
    """Raise ValueError unless `config` can be split across `world_size` ranks.

    Query heads, KV heads and the MLP width must all divide evenly (KV heads are not
    replicated: with ``world_size > num_key_value_heads`` lower the tensor-parallel size).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {world_size!r}")
    config = _text_config(config)
    model_type = getattr(config, "model_type", None)
    if model_type not in TP_MODEL_TYPES:
        raise ValueError(
            f"tensor parallelism supports model types {', '.join(TP_MODEL_TYPES)}; got "
            f"{model_type!r} (DeepSeek MLA is not sharded yet); use tensor_parallel_size=1"
        )
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    inter = int(config.intermediate_size)
    problems = [
        f"{name}={value}"
        for name, value in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads),
                            ("intermediate_size", inter))
        if value % world_size
    ]
    if problems:
        divisors = [n for n in range(1, kv_heads + 1)
                    if heads % n == 0 and kv_heads % n == 0 and inter % n == 0]
        raise ValueError(
            f"tensor_parallel_size={world_size} does not divide {', '.join(problems)}; each "
            f"rank must hold whole heads (KV heads are not replicated). Sizes that work for "
            f"this model: {divisors}"
        )


def rank_config(config: Any, world_size: int) -> Any:
    """A copy of `config` describing one rank's shard (heads and MLP width divided by
    `world_size`, ``head_dim`` made explicit); KV-cache specs are built from it."""
    check_shardable(config, world_size)
    out = copy.deepcopy(config)
    text = _text_config(out)
    text.head_dim = _head_dim(text)
    text.num_attention_heads = int(text.num_attention_heads) // world_size
    kv_heads = int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
    text.num_key_value_heads = kv_heads // world_size
    text.intermediate_size = int(text.intermediate_size) // world_size
    return out


class RowParallelLinear(torch.nn.Module):
    """A ``Linear`` split along its input: ``all_reduce(x @ weight.T) + bias``.

    Parameters
    ----------
    weight:
        ``[out_features, in_features / N]``: this rank's input columns.
    bias:
        ``[out_features]`` (the full bias, added once after the reduction) or None.
    all_reduce:
        Sums a tensor across the ranks in place (``torch.distributed.all_reduce`` on the
        tensor-parallel group).
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        all_reduce: Callable[[torch.Tensor], None],
    ) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.in_features = int(weight.shape[1])
        self.out_features = int(weight.shape[0])
        self._all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.linear(x, self.weight)
        self._all_reduce(out)
        return out if self.bias is None else out + self.bias


def _column_slice(linear: Any, lo: int, hi: int) -> torch.nn.Linear:
    w = linear.weight.detach()[lo:hi].clone()
    out = torch.nn.Linear(w.shape[1], w.shape[0], bias=linear.bias is not None,
                          device=w.device, dtype=w.dtype)
    out.weight = torch.nn.Parameter(w, requires_grad=False)
    if linear.bias is not None:
        out.bias = torch.nn.Parameter(linear.bias.detach()[lo:hi].clone(), requires_grad=False)
    return out


def _row_slice(
    linear: Any, lo: int, hi: int, all_reduce: Callable[[torch.Tensor], None]
) -> RowParallelLinear:
    w = linear.weight.detach()[:, lo:hi].clone()
    bias = None if linear.bias is None else linear.bias.detach().clone()
    return RowParallelLinear(w, bias, all_reduce=all_reduce)


def shard_model(
    model: Any,
    *,
    rank: int,
    world_size: int,
    all_reduce: Callable[[torch.Tensor], None],
) -> None:
    """Keep rank `rank`'s share of every decoder layer of `model`, in place.

    Parameters
    ----------
    model:
        A transformers causal LM of a type in `TP_MODEL_TYPES`, full weights loaded.
    rank, world_size:
        This rank and the tensor-parallel size.
    all_reduce:
        In-place sum across the ranks, called after ``o_proj`` and ``down_proj``.
    """
    config = _text_config(model.config)
    check_shardable(config, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size})")
    head_dim = _head_dim(config)
    heads = int(config.num_attention_heads) // world_size
    kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    kv_heads //= world_size
    inter = int(config.intermediate_size) // world_size
    base = getattr(model, model.base_model_prefix)
    q_lo, q_hi = rank * heads * head_dim, (rank + 1) * heads * head_dim
    kv_lo, kv_hi = rank * kv_heads * head_dim, (rank + 1) * kv_heads * head_dim
    m_lo, m_hi = rank * inter, (rank + 1) * inter
    for layer in base.layers:
        attn = layer.self_attn
        attn.q_proj = _column_slice(attn.q_proj, q_lo, q_hi)
        attn.k_proj = _column_slice(attn.k_proj, kv_lo, kv_hi)
        attn.v_proj = _column_slice(attn.v_proj, kv_lo, kv_hi)
        attn.o_proj = _row_slice(attn.o_proj, q_lo, q_hi, all_reduce)
        mlp = layer.mlp
        mlp.gate_proj = _column_slice(mlp.gate_proj, m_lo, m_hi)
        mlp.up_proj = _column_slice(mlp.up_proj, m_lo, m_hi)
        mlp.down_proj = _row_slice(mlp.down_proj, m_lo, m_hi, all_reduce)
        if hasattr(mlp, "intermediate_size"):
            mlp.intermediate_size = inter
