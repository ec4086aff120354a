"""KV config from transformers configs built in code (no downloads): specs, groups, budget."""

from __future__ import annotations

import re
import types

import pytest
from transformers import (
    DeepseekV2Config,
    DeepseekV3Config,
    Gemma2Config,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from pagedcore.kv_cache.config import (
    kv_cache_specs_from_hf_config,
    make_kv_cache_config,
    unify_page_sizes,
)
from pagedcore.kv_cache.spec import (
    FullAttentionSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

SMALL = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}


def test_llama_full_attention_gqa() -> None:
    specs = kv_cache_specs_from_hf_config(
        LlamaConfig(num_hidden_layers=3, **SMALL), block_size=16, dtype="bfloat16"
    )
    assert list(specs) == [f"model.layers.{i}.self_attn" for i in range(3)]
    spec = specs["model.layers.0.self_attn"]
    assert spec == FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype="bfloat16")
    assert spec.page_size_bytes == 2 * 16 * 2 * 16 * 2


def test_qwen3_explicit_head_dim_and_torch_dtype() -> None:
    import torch

    specs = kv_cache_specs_from_hf_config(
        Qwen3Config(num_hidden_layers=2, head_dim=32, **SMALL), block_size=8, dtype=torch.float32
    )
    spec = specs["model.layers.1.self_attn"]
    assert (spec.head_size, spec.dtype, type(spec)) == (32, "float32", FullAttentionSpec)


def test_qwen2_sliding_layers_follow_layer_types() -> None:
    cfg = Qwen2Config(
        num_hidden_layers=4, use_sliding_window=True, sliding_window=64, max_window_layers=2,
        **SMALL,
    )
    specs = kv_cache_specs_from_hf_config(cfg, block_size=16, dtype="float16")
    kinds = [type(s).__name__ for s in specs.values()]
    assert kinds == ["FullAttentionSpec"] * 2 + ["SlidingWindowSpec"] * 2
    plain = kv_cache_specs_from_hf_config(Qwen2Config(num_hidden_layers=2, **SMALL),
                                          block_size=16, dtype="float16")
    assert all(type(s) is FullAttentionSpec for s in plain.values())


@pytest.mark.parametrize("window", [None, 32])
def test_mistral_sliding_window_may_be_none(window: int | None) -> None:
    specs = kv_cache_specs_from_hf_config(
        MistralConfig(num_hidden_layers=2, sliding_window=window, **SMALL),
        block_size=16, dtype="float16",
    )
    spec = specs["model.layers.0.self_attn"]
    if window is None:
        assert type(spec) is FullAttentionSpec
    else:
        assert isinstance(spec, SlidingWindowSpec) and spec.sliding_window == 32


def test_gemma2_alternates_and_groups_equally() -> None:
    cfg = Gemma2Config(num_hidden_layers=6, sliding_window=64, head_dim=16, **SMALL)
    specs = kv_cache_specs_from_hf_config(cfg, block_size=16, dtype="bfloat16")
    assert [isinstance(s, SlidingWindowSpec) for s in specs.values()] == [True, False] * 3
    # Without layer_types, transformers' rule: even layers slide.
    cfg.layer_types = None
    again = kv_cache_specs_from_hf_config(cfg, block_size=16, dtype="bfloat16")
    assert again == specs
    page = specs["model.layers.0.self_attn"].page_size_bytes
    kv = make_kv_cache_config(specs, memory_bytes=3 * 100 * page, max_model_len=256,
                              max_num_batched_tokens=64)
    assert kv.num_blocks == 100
    assert [g.layer_names for g in kv.groups] == [
        ("model.layers.0.self_attn", "model.layers.2.self_attn", "model.layers.4.self_attn"),
        ("model.layers.1.self_attn", "model.layers.3.self_attn", "model.layers.5.self_attn"),
    ]
    assert [t.shared_by for t in kv.tensors] == [
        ("model.layers.0.self_attn", "model.layers.1.self_attn"),
        ("model.layers.2.self_attn", "model.layers.3.self_attn"),
        ("model.layers.4.self_attn", "model.layers.5.self_attn"),
    ]
    assert all(t.size_bytes == 100 * page for t in kv.tensors)


def test_uneven_hybrid_pads_the_last_group() -> None:
    sw = SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16",
                           sliding_window=8)
    full = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16")
    specs = {f"l{i}": (full if i < 2 else sw) for i in range(5)}  # 2 full, 3 sliding
    kv = make_kv_cache_config(specs, memory_bytes=10**6, max_model_len=64,
                              max_num_batched_tokens=16)
    assert [g.layer_names for g in kv.groups] == [("l0", "l1"), ("l2", "l3"), ("l4",)]
    assert [t.shared_by for t in kv.tensors] == [("l0", "l2", "l4"), ("l1", "l3")]
    assert kv.num_blocks == 10**6 // (2 * full.page_size_bytes)


def test_deepseek_mla_page_size() -> None:
    for cls in (DeepseekV2Config, DeepseekV3Config):
        cfg = cls(num_hidden_layers=2, kv_lora_rank=32, qk_rope_head_dim=8, hidden_size=64,
                  num_attention_heads=4, vocab_size=100)
        specs = kv_cache_specs_from_hf_config(cfg, block_size=16, dtype="bfloat16")
        spec = specs["model.layers.1.self_attn"]
        assert isinstance(spec, MLAAttentionSpec)
        assert (spec.num_kv_heads, spec.head_size) == (1, 40)
        assert spec.page_size_bytes == 16 * 40 * 2  # one latent vector per token, no x2
        kv = make_kv_cache_config(specs, memory_bytes=10 * 2 * spec.page_size_bytes,
                                  max_model_len=64, max_num_batched_tokens=16)
        assert len(kv.groups) == 1 and kv.num_blocks == 10


def test_unify_page_sizes_scales_block_size_or_errors() -> None:
    big = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=16, dtype="float16")
    small = SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=16, dtype="float16",
                              sliding_window=32)
    out = unify_page_sizes({"a": big, "b": small})
    assert out["b"].block_size == 64 and out["b"].page_size_bytes == big.page_size_bytes
    odd = FullAttentionSpec(block_size=16, num_kv_heads=3, head_size=16, dtype="float16")
    with pytest.raises(ValueError, match="cannot unify KV-cache page sizes"):
        unify_page_sizes({"a": big, "b": odd})


def test_budget_too_small_says_needed_available_and_what_fits() -> None:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype="float16")
    specs = {"l0": spec, "l1": spec}
    per_block = 2 * spec.page_size_bytes
    # 10 blocks: null + 9 usable -> 144 tokens fit; 1024 tokens need 64 + 1 blocks.
    with pytest.raises(ValueError) as err:
        make_kv_cache_config(specs, memory_bytes=10 * per_block, max_model_len=1024,
                             max_num_batched_tokens=256)
    msg = str(err.value)
    assert f"needs {65 * per_block} bytes" in msg
    assert f"{10 * per_block} bytes are available" in msg
    assert re.search(r"longest max_model_len that fits is 144\b", msg)
    with pytest.raises(ValueError, match="not even one block"):
        make_kv_cache_config(specs, memory_bytes=per_block, max_model_len=16,
                             max_num_batched_tokens=16)


def test_sliding_window_needs_less_memory_than_full() -> None:
    sw = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=16, dtype="float16",
                           sliding_window=64)
    per_block = sw.page_size_bytes
    # Window 64 + 64 batched tokens -> cdiv(127, 16) + 1 = 9 blocks (+ null) for any length.
    kv = make_kv_cache_config({"l0": sw}, memory_bytes=10 * per_block, max_model_len=10**5,
                              max_num_batched_tokens=64)
    assert kv.num_blocks == 10


def test_unknown_layer_type_and_missing_fields_are_clear() -> None:
    cfg = LlamaConfig(num_hidden_layers=2, **SMALL)
    cfg.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ValueError, match="layer 1 has type 'linear_attention'"):
        kv_cache_specs_from_hf_config(cfg, block_size=16, dtype="float16")
    cfg_like = types.SimpleNamespace(model_type="mystery", num_hidden_layers=2, hidden_size=64)
    with pytest.raises(ValueError, match="'mystery' config: it has no 'num_attention_heads'"):
        kv_cache_specs_from_hf_config(cfg_like, block_size=16, dtype="float16")
