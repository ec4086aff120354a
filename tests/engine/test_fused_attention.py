"""Fused rotary embedding and QKV projection (`pagedcore.engine.models.fused_attention`) and
the fused residual add + RMSNorm (`fused_decoder`) against transformers' own modules, and the
``PAGEDCORE_FUSED_KERNELS`` kinds.

On CUDA the kernel runs compiled (bit-identical to torch's ops); elsewhere in Triton's CPU
interpreter (exact in fp32; it rounds fp32 -> bf16 toward zero, so bf16 is off by an ulp).
"""

from __future__ import annotations

import copy
import importlib.util
import os
from typing import Any

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import
if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton", allow_module_level=True)

from engine_helpers import random_prompts  # noqa: E402

from pagedcore.engine.models.fused_attention import (  # noqa: E402
    FusedAttention,
    apply_rotary,
    swap_fused_attention,
)
from pagedcore.engine.models.fused_decoder import (  # noqa: E402
    FusedDecoderLayer,
    swap_fused_decoder_layers,
)
from pagedcore.engine.models.fused_ops import (  # noqa: E402
    FUSED_KERNELS_ENV,
    FUSED_KINDS,
    GPU_CHECKED_KINDS,
    FusedSiLUMulMLP,
    add_rms_norm,
    fused_kinds_setting,
    silu_and_mul,
    silu_and_mul_stacked,
    swap_fused_modules,
)
from pagedcore.engine.models.loading import random_model, tiny_config  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")


def _rope(tokens: int, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin ``[1, T, D]`` as transformers' rotary module builds them (positions 3..)."""
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = (torch.arange(tokens).float() + 3)[:, None] * inv[None]
    emb = torch.cat([freqs, freqs], dim=-1)[None]
    return emb.cos().to(DEVICE, dtype), emb.sin().to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 2, 64), (7, 1, 16)])
def test_rotary_matches_transformers_on_a_fused_qkv_row(heads: int, kv_heads: int, dim: int,
                                                       dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    tokens = 5
    g = torch.Generator().manual_seed(heads)
    qk_width = (heads + kv_heads) * dim
    # A QKV row: q and k heads, then v, then NaN past them (the kernel must not read there).
    row = torch.full((tokens, qk_width + kv_heads * dim + 8), float("nan"))
    row[:, :qk_width + kv_heads * dim] = torch.randn(tokens, qk_width + kv_heads * dim,
                                                     generator=g)
    row = row.to(DEVICE, dtype)
    row[:, qk_width:qk_width + kv_heads * dim] = float("nan")  # v: not the kernel's to read
    qk = row[:, :qk_width].view(tokens, heads + kv_heads, dim)
    cos, sin = _rope(tokens, dim, dtype)
    q, k = apply_rotary(qk, cos, sin, first_heads=heads)
    assert q.shape == (tokens, heads, dim) and k.shape == (tokens, kv_heads, dim)
    assert q.is_contiguous() and k.is_contiguous()
    want_q, want_k = apply_rotary_pos_emb(qk[:, :heads].transpose(0, 1)[None],
                                          qk[:, heads:].transpose(0, 1)[None], cos, sin)
    # With the v heads: rotated q and k as before, v copied bit for bit into its own buffer.
    v_width = qk_width + kv_heads * dim
    row[:, qk_width:v_width] = torch.randn(tokens, kv_heads * dim, generator=g).to(DEVICE, dtype)
    qkv = row[:, :v_width].view(tokens, heads + 2 * kv_heads, dim)
    q3, k3, v3 = apply_rotary(qkv, cos, sin, first_heads=heads, second_heads=kv_heads)
    assert torch.equal(q3, q) and torch.equal(k3, k) and v3.is_contiguous()
    assert torch.equal(v3, qkv[:, heads + kv_heads:])
    for got, want in ((q, want_q[0].transpose(0, 1)), (k, want_k[0].transpose(0, 1))):
        assert not got.isnan().any()
        if dtype == torch.float32 or CUDA:
            assert torch.equal(got, want)
        else:  # the interpreter's truncating bf16 rounding: about one ulp of the products
            err = (got.float() - want.float()).abs().max() / want.float().abs().max()
            assert float(err) < 2e-2


def test_rotary_bad_inputs_say_what_is_wrong() -> None:
    x = torch.randn(3, 2, 8, device=DEVICE)
    cos, sin = _rope(3, 8, torch.float32)
    with pytest.raises(ValueError, match="do not match x"):
        apply_rotary(x, cos[:, :2], sin[:, :2], first_heads=1)
    with pytest.raises(ValueError, match="cast them to x's dtype"):
        apply_rotary(x, cos.double(), sin.double(), first_heads=1)
    with pytest.raises(ValueError, match="within the 2 heads"):
        apply_rotary(x, cos, sin, first_heads=1, second_heads=2)
    with pytest.raises(ValueError, match="must be even"):
        apply_rotary(torch.randn(3, 2, 7, device=DEVICE), cos[..., :7], sin[..., :7],
                     first_heads=1)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("fuse_qkv", [False, True])
def test_swapped_attention_computes_the_same_logits(arch: str, fuse_qkv: bool) -> None:
    """fp32: logits of a prompt and of a batch equal the unswapped model's; parameters,
    memory and state-dict keys unchanged; the q/k/v parameters alias the stacked GEMM."""
    ref = random_model(tiny_config(arch), dtype=torch.float32, device=DEVICE)
    model = copy.deepcopy(ref)
    keys = list(model.state_dict())
    numel = sum(p.numel() for p in model.parameters())
    assert swap_fused_attention(model, fuse_qkv=fuse_qkv) == {"rotary": 2,
                                                               "qkv": 2 if fuse_qkv else 0}
    assert list(model.state_dict()) == keys
    assert sum(p.numel() for p in model.parameters()) == numel
    attn: Any = model.model.layers[0].self_attn
    assert isinstance(attn, FusedAttention) and attn.fused_qkv is fuse_qkv
    prompt = torch.tensor(random_prompts([12], seed=3), device=DEVICE)
    batch = torch.tensor(random_prompts([3, 3, 3], seed=4), device=DEVICE)
    with torch.no_grad():
        for ids in (prompt, batch):
            want, got = ref(ids).logits, model(ids).logits
            assert float((got - want).abs().max() / want.abs().max()) < 1e-6
        # Weights loaded into a projection after the swap reach the stacked GEMM.
        if fuse_qkv:
            attn.k_proj.weight.mul_(2.0)
            ref.model.layers[0].self_attn.k_proj.weight.mul_(2.0)
            want, got = ref(prompt).logits, model(prompt).logits
            assert float((got - want).abs().max() / want.abs().max()) < 1e-6
            # A replaced weight: the three projections run on their own again.
            attn.v_proj.weight = torch.nn.Parameter(attn.v_proj.weight * 3.0)
            ref.model.layers[0].self_attn.v_proj.weight.mul_(3.0)
            assert not attn.fused_qkv
            want, got = ref(prompt).logits, model(prompt).logits
            assert float((got - want).abs().max() / want.abs().max()) < 1e-6


def test_qwen3_and_mistral_attention_are_left_alone() -> None:
    for arch in ("qwen3", "mistral"):
        model = random_model(tiny_config(arch), dtype=torch.float32, device=DEVICE)
        assert swap_fused_attention(model) == {"rotary": 0, "qkv": 0}


def test_kinds_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FUSED_KERNELS_ENV, raising=False)
    # every kind but down_add (not bit-identical; waits for its GPU check)
    assert fused_kinds_setting() == frozenset(GPU_CHECKED_KINDS) == frozenset(FUSED_KINDS) - {
        "down_add"}
    for all_kinds in ("1", "all", " ON "):
        monkeypatch.setenv(FUSED_KERNELS_ENV, all_kinds)
        assert fused_kinds_setting() == frozenset(FUSED_KINDS)
    monkeypatch.setenv(FUSED_KERNELS_ENV, "off")
    assert fused_kinds_setting() == frozenset()
    monkeypatch.setenv(FUSED_KERNELS_ENV, " rms_norm, rotary ")
    assert fused_kinds_setting() == {"rms_norm", "rotary"}
    monkeypatch.setenv(FUSED_KERNELS_ENV, "rms_norm,rope")
    with pytest.raises(ValueError, match=r"names rope, which is not a fused kernel kind; set it "
                                         r"to 1 \(all\), 0 \(none\) or a comma list of rms_norm"):
        fused_kinds_setting()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_add_rms_norm_matches_add_then_norm(dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    rows, size = 6, 96
    g = torch.Generator().manual_seed(7)
    norm = LlamaRMSNorm(size, eps=1e-2).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + torch.randn(size, generator=g))
    # x's rows are views into a NaN-padded buffer (row stride size + 5).
    buf = torch.full((rows, size + 5), float("nan"), dtype=dtype, device=DEVICE)
    buf[:, :size] = torch.randn(rows, size, generator=g).to(DEVICE, dtype)
    x = buf[:, :size]
    residual = torch.randn(rows, size, generator=g).to(DEVICE, dtype)
    normed, total = add_rms_norm(x, residual, norm.weight, eps=1e-2)
    want_total = residual + x
    assert torch.equal(total, want_total) or (not CUDA and dtype != torch.float32
                                              and float((total - want_total).abs().max()) < 0.05)
    want = norm(want_total).detach()
    err = (normed.double() - want.double()).abs().max() / want.double().abs().max()
    assert float(err) < (1e-5 if dtype == torch.float32 else 2e-2), float(err)
    with pytest.raises(ValueError, match="differ; pass the sublayer's output and its input"):
        add_rms_norm(x, residual[:, :5], norm.weight, eps=1e-2)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_fused_decoder_layers_compute_the_same_logits(arch: str) -> None:
    """fp32, every swap together (what the engine does on CUDA) against transformers."""
    ref = random_model(tiny_config(arch), dtype=torch.float32, device=DEVICE)
    model = copy.deepcopy(ref)
    keys = list(model.state_dict())
    counts = swap_fused_modules(model, kinds=frozenset(FUSED_KINDS))
    assert counts["gate_up"] == 2
    mlp: Any = model.model.layers[0].mlp
    assert isinstance(mlp, FusedSiLUMulMLP) and mlp.fused_gate_up
    swap_fused_attention(model)
    assert swap_fused_decoder_layers(model, down_add=True) == 2
    layer: Any = model.model.layers[1]
    assert isinstance(layer, FusedDecoderLayer) and layer.down_add
    assert list(model.state_dict()) == keys
    ids = torch.tensor(random_prompts([9, 9], seed=5), device=DEVICE)
    with torch.no_grad():
        want, got = ref(ids).logits, model(ids).logits
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_down_add_accumulates_the_mlp_into_the_residual(dtype: torch.dtype) -> None:
    """`FusedSiLUMulMLP.add_into`: the down projection adds into the residual in place, in
    one GEMM (its `forward` is never called) when down_proj is a bias-free `nn.Linear`, and
    through ``residual += down_proj(...)`` otherwise (a bias, a subclass: a sharded layer)."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    config = tiny_config("llama", hidden_size=64, intermediate_size=96)
    torch.manual_seed(3)
    orig = LlamaMLP(config).to(DEVICE, dtype)
    mlp = FusedSiLUMulMLP(copy.deepcopy(orig), fuse_gate_up=True)
    x = torch.randn(2, 5, 64, device=DEVICE).to(dtype)
    residual = torch.randn(2, 5, 64, device=DEVICE).to(dtype)
    with torch.no_grad():
        want = (residual.float() + orig(x).float())

        def refuse(*_a: Any) -> None:
            raise AssertionError("down_proj.forward ran: the add was not fused")

        mlp.down_proj.forward = refuse  # type: ignore[method-assign]
        into = residual.clone()
        got = mlp.add_into(x, into)
        assert got is into
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert float((got.float() - want).abs().max() / want.abs().max()) < tol
        # the MLP's own share, measured on its scale (~0.1 of the residual's here)
        mlp_part, mlp_want = got.float() - residual.float(), orig(x).float()
        part_tol = 1e-5 if dtype == torch.float32 else 0.05
        assert float((mlp_part - mlp_want).abs().max() / mlp_want.abs().max()) < part_tol
        del mlp.down_proj.forward
        # fallback: a down projection with a bias (or any other module) runs as usual
        biased = FusedSiLUMulMLP(copy.deepcopy(orig))
        biased.down_proj = torch.nn.Linear(96, 64, bias=True).to(DEVICE, dtype)
        calls: list[int] = []
        biased.down_proj.register_forward_hook(lambda *_a: calls.append(1))
        into = residual.clone()
        got = biased.add_into(x, into)
        want = residual.float() + biased(x).float()
        assert calls == [1, 1] and got is into
        assert float((got.float() - want).abs().max() / want.abs().max()) < tol
        # a plain Linear with a forward hook (an adapter, a probe) keeps its forward too
        hooked = FusedSiLUMulMLP(copy.deepcopy(orig))
        hooked.down_proj.register_forward_hook(lambda *_a: calls.append(2))
        hooked.add_into(x, residual.clone())
        assert calls[-1] == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_silu_and_mul_stacked_reads_both_halves_in_place(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(9)
    rows, inter = 5, 1100  # two blocks of 1,024 per row, the second partial
    buf = torch.full((rows, 2 * inter + 3), float("nan"), dtype=dtype, device=DEVICE)
    buf[:, :2 * inter] = (2 * torch.randn(rows, 2 * inter, generator=g)).to(DEVICE, dtype)
    gate_up = buf[:, :2 * inter]  # row stride 2I + 3; NaN past each row
    got = silu_and_mul_stacked(gate_up)
    want = silu_and_mul(gate_up[:, :inter], gate_up[:, inter:])
    assert got.shape == (rows, inter) and not got.isnan().any()
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="is odd"):
        silu_and_mul_stacked(gate_up[:, :7])
