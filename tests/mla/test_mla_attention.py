"""The swapped-in paged MLA attention against transformers' own DeepSeek attention."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from mla_helpers import dense_common, seeded_model, tiny_deepseek_config

from pagedcore.engine.models.attention_hook import LayerBinding, StepContext
from pagedcore.engine.models.mla_attention import (
    PagedMLAAttention,
    is_mla_config,
    mla_impl_kwargs,
    swap_mla_attention,
)
from pagedcore.kv_cache.spec import MLAAttentionSpec
from pagedcore.reference.mla import ReferenceMLABackend


def _backends() -> list[Any]:
    out: list[Any] = [ReferenceMLABackend]
    try:
        from pagedcore_triton.mla import TritonMLABackend
    except ImportError:
        return out
    if TritonMLABackend.is_available() is None and TritonMLABackend.supported_devices.count("cpu"):
        out.append(TritonMLABackend)
    return out


CONFIGS = {
    "v2": ("deepseek_v2", {}),
    "v2_q_lora": ("deepseek_v2", {"q_lora_rank": 24}),
    "v3_interleave": ("deepseek_v3", {"rope_interleave": True}),
    "v3_plain": ("deepseek_v3", {"rope_interleave": False}),
}


def _dense_reference(orig: Any, rotary: Any, hidden: torch.Tensor) -> torch.Tensor:
    seq = hidden.shape[1]
    pos = torch.arange(seq)[None]
    mask = torch.full((seq, seq), float("-inf")).triu(1)[None, None]
    out, _ = orig(hidden_states=hidden, position_embeddings=rotary(hidden, pos),
                  attention_mask=mask)
    return out[0]  # type: ignore[no-any-return]


@pytest.mark.parametrize("backend", _backends(), ids=lambda b: b.name)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_paged_mla_matches_transformers_attention(name: str, backend: Any) -> None:
    """Chunked prefill then decode through the latent cache == dense transformers attention."""
    model_type, overrides = CONFIGS[name]
    config = tiny_deepseek_config(model_type, **overrides)
    model = seeded_model(config, seed=3)
    orig = model.model.layers[1].self_attn
    rotary = model.model.rotary_emb
    swapped = swap_mla_attention(model)
    assert list(swapped) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    new = model.model.layers[1].self_attn
    assert isinstance(new, PagedMLAAttention) and new.kv_b_proj is orig.kv_b_proj

    gen = torch.Generator().manual_seed(0)
    lens = [10, 15]
    hidden = [torch.randn(1, n, config.hidden_size, generator=gen) for n in lens]
    with torch.no_grad():
        want = [_dense_reference(orig, rotary, h) for h in hidden]
    spec = MLAAttentionSpec(block_size=4, kv_lora_rank=config.kv_lora_rank,
                            rope_head_dim=config.qk_rope_head_dim, dtype="float32")
    cache = torch.full(backend.get_kv_cache_shape(16, 4, 1, spec.head_size), float("nan"))
    impl = backend.get_impl_cls()(new.num_heads, new.head_size, new.scaling,
                                  **mla_impl_kwargs(spec))
    builder = backend.get_builder_cls()(spec, ["model.layers.1.self_attn"], torch.device("cpu"))
    perm_gen = torch.Generator().manual_seed(1)
    table_common = dense_common(lens, lens, block_size=4, num_blocks=16, gen=perm_gen)
    # Steps as (query_lens, seq_lens), decode-first: chunked prefill, another chunk, decodes.
    steps = [([5, 8], [5, 8]), ([4, 6], [9, 14]), ([1, 1], [10, 15])]
    for q_lens, s_lens in steps:
        common = dense_common(q_lens, s_lens, block_size=4, num_blocks=16, gen=perm_gen)
        common = _with_table(common, table_common.block_table, q_lens, s_lens)
        rows = torch.cat([h[0, s - q : s] for h, q, s in zip(hidden, q_lens, s_lens,
                                                               strict=True)])[None]
        ctx = StepContext(layers={1: LayerBinding(impl, cache, 0)},
                          metadata=(builder.build(common),),
                          slot_mappings=(common.slot_mapping,))
        with torch.no_grad():
            out, _ = new(rows, position_embeddings=rotary(rows, common.positions[None]),
                         pagedcore_ctx=ctx)
        start = 0
        for r, (q, s) in enumerate(zip(q_lens, s_lens, strict=True)):
            torch.testing.assert_close(out[0, start : start + q], want[r][s - q : s],
                                       rtol=1e-4, atol=1e-5, msg=f"request {r} step {s_lens}")
            start += q


def _with_table(common: Any, table: torch.Tensor, q_lens: list[int], s_lens: list[int]) -> Any:
    """Reuse one block table across steps (the cache persists) and recompute the slots."""
    import attrs

    bs = 4
    slots = [int(table[r, p // bs]) * bs + p % bs
             for r, (q, s) in enumerate(zip(q_lens, s_lens, strict=True)) for p in range(s - q, s)]
    return attrs.evolve(common, block_table=table,
                        slot_mapping=torch.tensor(slots, dtype=torch.int64))


def test_swap_leaves_other_models_and_state_dict_alone() -> None:
    config = tiny_deepseek_config()
    assert is_mla_config(config)
    model = seeded_model(config)
    keys = set(model.state_dict())
    swap_mla_attention(model)
    assert set(model.state_dict()) == keys
    from transformers import LlamaConfig

    assert not is_mla_config(LlamaConfig())


def test_missing_context_is_a_clear_error() -> None:
    model = seeded_model(tiny_deepseek_config())
    swap_mla_attention(model)
    with pytest.raises(RuntimeError, match="pagedcore_ctx"):
        model(torch.tensor([[3, 4, 5]]))
