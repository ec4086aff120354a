"""The explicit swap of transformers' DeepSeek-V2/V3 attention for paged latent attention (MLA).

transformers' `DeepseekV2Attention` (and V3's) decompresses the latent into per-head K and V
before its attention function runs, so a paged cache behind `AttentionInterface` would have to
hold the decompressed K/V. `swap_mla_attention` replaces each such module by a
`PagedMLAAttention` that reuses the original projections (same parameters, same state-dict keys)
and stores only ``[c ; k_pe]`` per token: the normalised compressed latent (``kv_lora_rank = L``
values) and the roped shared key (``qk_rope_head_dim = R`` values).

Weight absorption, for every token (decode and prefill alike)::

    W_UK, W_UV = kv_b_proj.weight.view(H, nope + v, L).split([nope, v], dim=1)
    q_lat  = q_nope @ W_UK                       # [T, H, L]
    scores = scale * ([q_lat ; q_pe] · [c ; k_pe])   # == scale * (q_nope·k_nope + q_pe·k_pe)
    o_lat  = softmax(scores) @ c                 # [T, H, L]   (the MLA backend)
    out    = o_proj((o_lat @ W_UV^T).flatten())  # [T, hidden]

The module is bound like every other attention layer: the engine's `StepContext` (keyword
argument ``pagedcore_ctx`` of the model's forward, which transformers forwards to every attention
module) maps its ``layer_idx`` to a `LayerBinding` (the MLA backend's impl, this layer's latent
cache) and its KV-cache group's metadata and slot mapping.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from pagedcore.engine.models.attention_hook import StepContext

__all__ = [
    "MLA_ATTENTION_CLASSES",
    "TINY_MLA_OVERRIDES",
    "PagedMLAAttention",
    "is_mla_config",
    "mla_impl_kwargs",
    "swap_mla_attention",
]

#: `pagedcore.engine.models.loading.tiny_config` overrides for the DeepSeek types: 4 heads (no GQA),
#: latent 32 + rope 8, nope 16, v 12; layer 0 dense, layer 1 a small MoE.
TINY_MLA_OVERRIDES: dict[str, dict[str, Any]] = {
    "deepseek_v2": dict(
        num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, moe_intermediate_size=32, n_routed_experts=4,
        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
    ),
}
TINY_MLA_OVERRIDES["deepseek_v3"] = {**TINY_MLA_OVERRIDES["deepseek_v2"], "n_group": 1,
                                     "topk_group": 1}

#: transformers attention classes that `swap_mla_attention` replaces.
MLA_ATTENTION_CLASSES = ("DeepseekV2Attention", "DeepseekV3Attention")


def is_mla_config(config: Any) -> bool:
    """True for a transformers config of a DeepSeek-V2/V3-style MLA model."""
    return all(
        getattr(config, name, None) is not None
        for name in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
    )


RopeFn = Callable[[Any, Any, Any], tuple[Any, Any]]


def _rope_for(orig: nn.Module) -> RopeFn:
    """The original module's own rotary function, as ``(q [B,H,S,R], k [B,1,S,R], emb)``."""
    module = sys.modules[type(orig).__module__]
    name = type(orig).__name__
    if name == "DeepseekV2Attention":
        apply_v2: Callable[..., tuple[Any, Any]] = module.apply_rotary_emb

        def rope_v2(q: Any, k: Any, emb: Any) -> tuple[Any, Any]:
            return apply_v2(q, k, emb.to(q.device))

        return rope_v2
    interleave = bool(getattr(orig.config, "rope_interleave", False))
    apply_v3: Callable[..., tuple[Any, Any]] = (
        module.apply_rotary_pos_emb_interleave if interleave else module.apply_rotary_pos_emb
    )

    def rope_v3(q: Any, k: Any, emb: Any) -> tuple[Any, Any]:
        cos, sin = emb
        return apply_v3(q, k, cos, sin)

    return rope_v3


class PagedMLAAttention(nn.Module):
    """A DeepSeek attention layer over a paged latent cache, with weight absorption.

    Built from the transformers module it replaces; its projections are that module's own
    (shared parameters, unchanged state-dict keys).

    Parameters
    ----------
    orig:
        A `DeepseekV2Attention` or `DeepseekV3Attention`.
    layer_name:
        The layer's name in the KV-cache config, ``"model.layers.{i}.self_attn"``.

    The backend impl (an MLA impl, see `pagedcore.reference.mla` for the contract) and the cache
    come from the step's `StepContext` binding of ``layer_idx``, as for every other layer.
    """

    def __init__(self, orig: nn.Module, *, layer_name: str) -> None:
        super().__init__()
        if type(orig).__name__ not in MLA_ATTENTION_CLASSES:
            raise TypeError(
                f"PagedMLAAttention replaces {' or '.join(MLA_ATTENTION_CLASSES)}, "
                f"got {type(orig).__name__}"
            )
        src: Any = orig
        self.config = src.config
        self.layer_idx = int(src.layer_idx)
        self.layer_name = layer_name
        self.num_heads = int(src.num_heads)
        self.kv_lora_rank = int(src.kv_lora_rank)
        self.qk_rope_head_dim = int(src.qk_rope_head_dim)
        self.qk_nope_head_dim = int(src.qk_nope_head_dim)
        self.v_head_dim = int(src.v_head_dim)
        self.scaling = float(src.scaling)
        self.q_lora_rank: int | None = src.q_lora_rank
        # The original's own submodules: shared parameters, unchanged state-dict keys.
        self.q_proj: Any = src.q_proj
        self.q_a_proj: Any = src.q_a_proj
        self.q_a_layernorm: Any = src.q_a_layernorm
        self.q_b_proj: Any = src.q_b_proj
        self.kv_a_proj_with_mqa: Any = src.kv_a_proj_with_mqa
        self.kv_a_layernorm: Any = src.kv_a_layernorm
        self.kv_b_proj: Any = src.kv_b_proj
        self.o_proj: Any = src.o_proj
        self._rope = _rope_for(orig)

    @property
    def head_size(self) -> int:
        """``L + R``: the cached row and the absorbed query size."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(W_UK [H, nope, L], W_UV [H, v, L])``: views of ``kv_b_proj.weight``."""
        weight: torch.Tensor = self.kv_b_proj.weight.view(
            self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank
        )
        return weight[:, : self.qk_nope_head_dim], weight[:, self.qk_nope_head_dim :]

    def latent_inputs(
        self, hidden_states: torch.Tensor, position_embeddings: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Project to the absorbed query and the cache row.

        Parameters
        ----------
        hidden_states:
            ``[B, S, hidden]`` in the model dtype (the engine passes ``B = 1``).
        position_embeddings:
            What the model's rotary embedding produced for these tokens.

        Returns
        -------
        tuple[torch.Tensor, torch.Tensor]
            ``query`` ``[B*S, H, L + R]`` and ``key`` ``[B*S, 1, L + R]``.
        """
        batch, seq = hidden_states.shape[:2]
        heads, nope, rope = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(batch, seq, heads, nope + rope).transpose(1, 2)  # [B, H, S, nope + R]
        q_nope, q_pe = torch.split(q, [nope, rope], dim=-1)
        compressed = self.kv_a_proj_with_mqa(hidden_states)
        c, k_pe = torch.split(compressed, [self.kv_lora_rank, rope], dim=-1)
        c = self.kv_a_layernorm(c)
        k_pe = k_pe.view(batch, 1, seq, rope)
        q_pe, k_pe = self._rope(q_pe, k_pe, position_embeddings)
        w_uk, _ = self.absorbed_weights()
        q_lat = torch.einsum("bhsn,hnl->bshl", q_nope, w_uk)
        query = torch.cat([q_lat, q_pe.transpose(1, 2)], dim=-1)
        key = torch.cat([c, k_pe[:, 0]], dim=-1)
        return query.reshape(batch * seq, heads, -1), key.reshape(batch * seq, 1, -1)

    def project_output(self, latent_out: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """``[T, H, L]`` latent output -> ``[B, S, hidden]`` through ``W_UV`` and ``o_proj``."""
        _, w_uv = self.absorbed_weights()
        out = torch.einsum("thl,hvl->thv", latent_out.to(w_uv.dtype), w_uv)
        result: torch.Tensor = self.o_proj(out.reshape(*shape, self.num_heads * self.v_head_dim))
        return result

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: Any = None,
        attention_mask: torch.Tensor | None = None,
        *,
        pagedcore_ctx: StepContext | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        """Paged MLA for ``hidden_states`` ``[B, S, hidden]`` -> ``([B, S, hidden], None)``.

        ``pagedcore_ctx`` (the engine's `StepContext`) is required; ``attention_mask`` is ignored
        (the backend masks from its metadata).
        """
        if pagedcore_ctx is None:
            raise RuntimeError(
                f"{self.layer_name}: PagedMLAAttention needs the step's StepContext as the model "
                "keyword argument 'pagedcore_ctx'; run the model through pagedcore.LLM"
            )
        binding = pagedcore_ctx.layers[self.layer_idx]
        slot_mapping = pagedcore_ctx.slot_mappings[binding.group]
        metadata = pagedcore_ctx.metadata[binding.group]
        batch, seq = hidden_states.shape[:2]
        query, key = self.latent_inputs(hidden_states, position_embeddings)
        if binding.calibration is not None and binding.calibration.pending:
            # An fp8 latent cache without checkpoint scales: k_scale from this first write.
            binding.calibration.maybe_calibrate(binding.impl, key, key, slot_mapping)
        binding.impl.do_kv_cache_update(key, key, binding.kv_cache, slot_mapping)
        latent = binding.impl.forward(query, key, key, binding.kv_cache, metadata)
        if latent.shape[0] < batch * seq:
            latent = _pad_rows(latent, batch * seq)
        return self.project_output(latent, (batch, seq)), None


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    pad = x.new_zeros(rows - x.shape[0], *x.shape[1:])
    return torch.cat([x, pad])


def mla_impl_kwargs(spec: Any) -> dict[str, Any]:
    """Extra keyword arguments an MLA impl needs for a layer of `spec` (empty for non-MLA)."""
    from pagedcore.kv_cache.spec import MLAAttentionSpec

    if isinstance(spec, MLAAttentionSpec):
        return {"kv_lora_rank": spec.kv_lora_rank}
    return {}


def swap_mla_attention(model: nn.Module) -> dict[str, PagedMLAAttention]:
    """Replace every DeepSeek-V2/V3 attention module of `model` by a `PagedMLAAttention`.

    Parameters
    ----------
    model:
        A transformers DeepSeek-V2/V3 model (``...ForCausalLM`` or the bare model). Other
        models are left untouched, so the engine may call this for every model.

    Returns
    -------
    dict[str, PagedMLAAttention]
        Layer name (``"model.layers.{i}.self_attn"``) -> the new module, in layer order.
        Empty when the model has no MLA attention.
    """
    swapped: dict[str, PagedMLAAttention] = {}
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module).__name__ in MLA_ATTENTION_CLASSES
    ]
    for name, module in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        new = PagedMLAAttention(module, layer_name=_layer_name(module))
        setattr(parent, attr, new)
        swapped[new.layer_name] = new
    return swapped


def _layer_name(module: nn.Module) -> str:
    """``"model.layers.{i}.self_attn"`` whatever the wrapper (``ForCausalLM`` adds nothing)."""
    idx: Any = module.layer_idx
    return f"model.layers.{int(idx)}.self_attn"
