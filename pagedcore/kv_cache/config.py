"""From a model config to a `KVCacheConfig`: per-layer specs, groups, block count.

1. `kv_cache_specs_from_hf_config` reads a transformers config (Llama, Qwen2, Qwen3, Mistral,
   Gemma-2, DeepSeek-V2/V3 and lookalikes) and returns one spec per attention layer, keyed
   ``"model.layers.{i}.self_attn"``.
2. `make_kv_cache_config` unifies page sizes, groups layers and sizes ``num_blocks`` from a
   memory budget.

Grouping. Layers with the same spec share one group (one block table). A model with several
layer types (Gemma-2: sliding and full layers alternating) gets several groups of equal layer
count ``G`` (the smallest layer count of any type): each type's layers are cut into chunks of
``G``; the last chunk of a type whose count is not a multiple of ``G`` holds fewer layers
(padding: its tensors' share goes unused). Tensor ``j`` backs layer ``j`` of every group, so a
block id means the same memory range in every group and one block pool serves all groups.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from pagedcore.kv_cache.spec import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    SlidingWindowSpec,
    cdiv,
)

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "group_layers",
    "kv_cache_specs_from_hf_config",
    "layer_name",
    "make_kv_cache_config",
    "num_blocks_per_request",
    "unify_page_sizes",
]

#: Model types whose configs are known to map correctly (others are tried generically).
SUPPORTED_MODEL_TYPES: tuple[str, ...] = (
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "gemma2",
    "deepseek_v2",
    "deepseek_v3",
)


def layer_name(index: int) -> str:
    """The engine's name for the attention module of decoder layer ``index``."""
    return f"model.layers.{index}.self_attn"


def _require(config: Any, name: str) -> Any:
    value = getattr(config, name, None)
    if value is None:
        model_type = getattr(config, "model_type", type(config).__name__)
        raise ValueError(
            f"cannot derive KV-cache specs from a {model_type!r} config: it has no {name!r}; "
            f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return value


def _layer_types(config: Any, num_layers: int) -> list[str]:
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        if len(layer_types) != num_layers:
            raise ValueError(
                f"config.layer_types has {len(layer_types)} entries for {num_layers} layers"
            )
        return list(layer_types)
    model_type = getattr(config, "model_type", None)
    if model_type == "gemma2":
        # transformers' Gemma2: even layers use the sliding window, odd layers full attention.
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    uses_window = getattr(config, "use_sliding_window", True)
    if uses_window and getattr(config, "sliding_window", None) is not None:
        return ["sliding_attention"] * num_layers
    if getattr(config, "attention_chunk_size", None) is not None:
        return ["chunked_attention"] * num_layers
    return ["full_attention"] * num_layers


def kv_cache_specs_from_hf_config(
    hf_config: Any, *, block_size: int, dtype: object
) -> dict[str, AttentionSpec]:
    """One KV-cache spec per attention layer of a transformers model config.

    Parameters
    ----------
    hf_config : transformers.PretrainedConfig
        E.g. ``LlamaConfig(...)``; a multimodal config's text config is used.
    block_size : int
        Tokens per block.
    dtype : str | torch.dtype
        KV-cache element dtype (``"bfloat16"``, ``torch.float32``, ...).

    Returns
    -------
    dict[str, AttentionSpec]
        ``"model.layers.{i}.self_attn"`` -> `FullAttentionSpec`, `SlidingWindowSpec`,
        `ChunkedLocalAttentionSpec` or `MLAAttentionSpec` (DeepSeek-V2/V3), in layer order.
    """
    config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    num_layers = int(_require(config, "num_hidden_layers"))
    if getattr(config, "kv_lora_rank", None) is not None:
        mla = MLAAttentionSpec(
            block_size=block_size,
            dtype=dtype,
            kv_lora_rank=int(config.kv_lora_rank),
            rope_head_dim=int(_require(config, "qk_rope_head_dim")),
        )
        return {layer_name(i): mla for i in range(num_layers)}

    num_heads = int(_require(config, "num_attention_heads"))
    num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
    head_size = getattr(config, "head_dim", None)
    if head_size is None:
        head_size = int(_require(config, "hidden_size")) // num_heads
    common: dict[str, Any] = {
        "block_size": block_size,
        "num_kv_heads": num_kv_heads,
        "head_size": int(head_size),
        "dtype": dtype,
    }
    specs: dict[str, AttentionSpec] = {}
    for i, kind in enumerate(_layer_types(config, num_layers)):
        spec: AttentionSpec
        if kind == "full_attention":
            spec = FullAttentionSpec(**common)
        elif kind == "sliding_attention":
            window = getattr(config, "sliding_window", None)
            if window is None:
                raise ValueError(
                    f"layer {i} is a sliding-window layer but config.sliding_window is None"
                )
            spec = SlidingWindowSpec(**common, sliding_window=int(window))
        elif kind == "chunked_attention":
            chunk = int(_require(config, "attention_chunk_size"))
            spec = ChunkedLocalAttentionSpec(**common, attention_chunk_size=chunk)
        else:
            raise ValueError(
                f"layer {i} has type {kind!r}, which has no paged KV cache here; supported: "
                "full_attention, sliding_attention, chunked_attention"
            )
        specs[layer_name(i)] = spec
    return specs


def unify_page_sizes(specs: Mapping[str, AttentionSpec]) -> dict[str, AttentionSpec]:
    """Give every spec the largest page size by multiplying smaller specs' block sizes.

    Raises ValueError when a page size does not divide the largest one.
    """
    if not specs:
        raise ValueError("no KV-cache specs given: the model has no attention layers")
    distinct = set(specs.values())
    largest = max(s.page_size_bytes for s in distinct)
    replace: dict[AttentionSpec, AttentionSpec] = {}
    for spec in distinct:
        page = spec.page_size_bytes
        if page == largest:
            continue
        if largest % page:
            raise ValueError(
                f"cannot unify KV-cache page sizes: {page} bytes ({spec!r}) does not divide "
                f"{largest} bytes; pick a block_size that makes the page sizes multiples of "
                "each other"
            )
        replace[spec] = attrs.evolve(spec, block_size=spec.block_size * (largest // page))
    return {name: replace.get(spec, spec) for name, spec in specs.items()}


def group_layers(specs: Mapping[str, AttentionSpec]) -> tuple[KVCacheGroupSpec, ...]:
    """Group layers by spec; several types give groups of equal size (see module docstring)."""
    by_spec: dict[AttentionSpec, list[str]] = {}
    for name, spec in specs.items():
        by_spec.setdefault(spec, []).append(name)
    if len(by_spec) == 1:
        ((spec, names),) = by_spec.items()
        return (KVCacheGroupSpec(layer_names=tuple(names), spec=spec),)
    size = min(len(names) for names in by_spec.values())
    return tuple(
        KVCacheGroupSpec(layer_names=tuple(names[i : i + size]), spec=spec)
        for spec, names in by_spec.items()
        for i in range(0, len(names), size)
    )


def num_blocks_per_request(
    groups: tuple[KVCacheGroupSpec, ...], max_model_len: int, max_num_batched_tokens: int
) -> int:
    """Most blocks (over all groups) one request of ``max_model_len`` tokens holds at once."""
    return sum(
        cdiv(
            g.spec.max_memory_usage_bytes(max_model_len, max_num_batched_tokens),
            g.spec.page_size_bytes,
        )
        for g in groups
    )


def make_kv_cache_config(
    specs: Mapping[str, AttentionSpec],
    *,
    memory_bytes: int,
    max_model_len: int,
    max_num_batched_tokens: int,
) -> KVCacheConfig:
    """Group layers, unify page sizes and size the block pool from a memory budget.

    Parameters
    ----------
    specs : Mapping[str, AttentionSpec]
        Layer name -> spec (from `kv_cache_specs_from_hf_config`).
    memory_bytes : int
        Bytes available for the KV cache of all layers.
    max_model_len : int
        Longest request; the budget must hold one such request (plus the null block).
    max_num_batched_tokens : int
        Tokens per step (bounds a sliding window's working set).

    Returns
    -------
    KVCacheConfig
        ``num_blocks`` includes the null block 0. ``tensors``: one per layer of a group, each
        ``num_blocks * page_size_bytes`` bytes, shared by the layers at that index of every group.

    Raises
    ------
    ValueError
        When page sizes cannot be unified, or the budget cannot hold one ``max_model_len``
        request (the message gives bytes needed, bytes available and the longest length that
        fits).
    """
    for name, value in (
        ("memory_bytes", memory_bytes),
        ("max_model_len", max_model_len),
        ("max_num_batched_tokens", max_num_batched_tokens),
    ):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    groups = group_layers(unify_page_sizes(specs))
    page = groups[0].spec.page_size_bytes
    num_tensors = max(len(g.layer_names) for g in groups)
    bytes_per_block = page * num_tensors
    num_blocks = memory_bytes // bytes_per_block

    needed = 1 + num_blocks_per_request(groups, max_model_len, max_num_batched_tokens)
    if num_blocks < needed:
        raise ValueError(_budget_error(groups, needed, bytes_per_block, memory_bytes, num_blocks,
                                       max_model_len, max_num_batched_tokens))

    tensors = tuple(
        KVCacheTensor(
            size_bytes=num_blocks * page,
            shared_by=tuple(g.layer_names[j] for g in groups if j < len(g.layer_names)),
        )
        for j in range(num_tensors)
    )
    return KVCacheConfig(num_blocks=num_blocks, groups=groups, tensors=tensors)


def _budget_error(
    groups: tuple[KVCacheGroupSpec, ...],
    needed: int,
    bytes_per_block: int,
    memory_bytes: int,
    num_blocks: int,
    max_model_len: int,
    max_num_batched_tokens: int,
) -> str:
    lo, hi = 0, max_model_len  # longest length whose blocks (+ null) fit: binary search
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if 1 + num_blocks_per_request(groups, mid, max_num_batched_tokens) <= num_blocks:
            lo = mid
        else:
            hi = mid - 1
    fits = (
        f"the longest max_model_len that fits is {lo}"
        if lo > 0
        else "not even one block per layer group fits"
    )
    return (
        f"KV-cache budget too small for one request of max_model_len={max_model_len}: it needs "
        f"{needed * bytes_per_block} bytes ({needed} blocks of {bytes_per_block} bytes, "
        f"including the null block) but {memory_bytes} bytes are available; {fits}. Give the "
        "KV cache more memory (kv_cache_memory_bytes / gpu_memory_utilization) or lower "
        "max_model_len."
    )
