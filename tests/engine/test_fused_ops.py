"""Fused RMSNorm / SiLU-and-mul kernels against transformers' own modules, and the swap.

On CUDA the kernels run compiled; elsewhere in Triton's CPU interpreter (which rounds
fp32 -> bf16 toward zero instead of to nearest, hence the looser bf16 tolerance).
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
    # Must precede the first import of triton in this process (as in tests/mla/conftest.py).
    os.environ.setdefault("TRITON_INTERPRET", "1")
if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton", allow_module_level=True)

from engine_helpers import random_prompts  # noqa: E402

from pagedcore.engine.models.fused_ops import (  # noqa: E402
    FUSED_KERNELS_ENV,
    FusedRMSNorm,
    FusedSiLUMulMLP,
    fused_kernels_disabled_reason,
    rms_norm,
    silu_and_mul,
    swap_fused_modules,
)
from pagedcore.engine.models.loading import random_model, tiny_config  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
#: Max |got - want| / max |want|: fp32 up to reduction order; fp16/bf16 about one ulp.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape)
    assert not got.isnan().any(), "NaN in the output"
    got, want = got.detach(), want.detach()
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


def rms_norm_module(arch: str, size: int, dtype: torch.dtype, *, eps: float) -> Any:
    """transformers' own RMSNorm class of `arch` with a random (not all-ones) weight."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    cls = {"llama": LlamaRMSNorm, "qwen2": Qwen2RMSNorm}[arch]
    module = cls(size, eps=eps).to(device=DEVICE, dtype=dtype)
    with torch.no_grad():
        module.weight.copy_(torch.randn(size, generator=torch.Generator().manual_seed(size)))
    return module


def nan_padded(data: torch.Tensor, pad: int) -> torch.Tensor:
    """`data` ``[R, N]`` as a view into a NaN-filled ``[R, N + pad]`` buffer (row stride N+pad)."""
    rows, size = data.shape
    buf = torch.full((rows, size + pad), float("nan"), dtype=data.dtype, device=data.device)
    buf[:, :size] = data
    return buf[:, :size]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("arch", "rows", "size"), [("llama", 1, 896), ("qwen2", 7, 100),
                                                   ("llama", 5, 64)])
def test_rms_norm_matches_transformers(arch: str, rows: int, size: int,
                                       dtype: torch.dtype) -> None:
    eps = 1e-2  # large against mean(x^2) = 0.01: a kernel that drops eps is off by ~40%
    module = rms_norm_module(arch, size, dtype, eps=eps)
    g = torch.Generator().manual_seed(rows)
    data = (0.1 * torch.randn(rows, size, generator=g)).to(device=DEVICE, dtype=dtype)
    x = nan_padded(data, pad=13)  # rows not contiguous; NaN past each row's end
    want = module(data)
    got = rms_norm(x, module.weight, eps=eps)
    assert rel_err(got, want) < TOL[dtype], (arch, rows, size, dtype, rel_err(got, want))
    fused = FusedRMSNorm(module)
    assert fused.weight is module.weight
    assert rel_err(fused(data.view(1, rows, size)), want.view(1, rows, size)) < TOL[dtype]


def test_rms_norm_promotes_like_transformers() -> None:
    """bf16 activations with an fp32 weight: fp32 out, rounded where transformers rounds."""
    module = rms_norm_module("llama", 96, torch.float32, eps=1e-6)
    x = torch.randn(3, 4, 96, device=DEVICE).to(torch.bfloat16)
    got, want = rms_norm(x, module.weight, eps=1e-6), module(x)
    assert got.dtype == want.dtype == torch.float32
    assert rel_err(got, want) < TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 4864), (3, 5, 100)], ids=str)
def test_silu_and_mul_matches_transformers(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    from transformers.activations import ACT2FN

    g = torch.Generator().manual_seed(len(shape))
    gate = (3 * torch.randn(shape, generator=g)).to(device=DEVICE, dtype=dtype)
    up = torch.randn(shape, generator=g).to(device=DEVICE, dtype=dtype)
    want = ACT2FN["silu"](gate) * up
    got = silu_and_mul(gate, up)
    assert rel_err(got, want) < TOL[dtype], (shape, dtype, rel_err(got, want))
    # Non-contiguous inputs (the transpose of a contiguous tensor) give the same values.
    got_t = silu_and_mul(gate.transpose(0, -1), up.transpose(0, -1))
    assert rel_err(got_t, want.transpose(0, -1)) < TOL[dtype]


def test_bad_inputs_say_what_is_wrong() -> None:
    x = torch.randn(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="does not match the last dimension"):
        rms_norm(x, torch.ones(9, device=DEVICE), eps=1e-6)
    with pytest.raises(ValueError, match="differ in shape"):
        silu_and_mul(x, torch.randn(2, 9, device=DEVICE))
    assert rms_norm(x[:0], torch.ones(8, device=DEVICE), eps=1e-6).shape == (0, 8)


def _randomise_norms(model: Any) -> None:
    """Give every norm weight seeded random values (all-ones would hide a dropped multiply)."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.5 * torch.randn(param.shape, generator=g))


def _pair(arch: str, dtype: torch.dtype, **overrides: Any) -> tuple[Any, Any]:
    config = tiny_config(arch, **overrides)
    models = [random_model(copy.deepcopy(config), dtype=dtype, device=DEVICE, seed=0)
              for _ in range(2)]
    for model in models:
        _randomise_norms(model)
    return models[0], models[1]


@pytest.mark.parametrize(("arch", "norms"), [("llama", 5), ("qwen2", 5), ("qwen3", 9),
                                             ("mistral", 5)])
def test_swapped_model_computes_the_same_logits(arch: str, norms: int) -> None:
    """fp32: the swapped model's logits equal the unswapped model's (so a wrong kernel fails);
    parameters and state-dict keys are unchanged."""
    ref, model = _pair(arch, torch.float32)
    keys = list(model.state_dict())
    params = {id(p) for p in model.parameters()}
    assert swap_fused_modules(model) == {"rms_norm": norms, "silu_mul": 2}
    assert list(model.state_dict()) == keys
    assert {id(p) for p in model.parameters()} == params
    assert sum(isinstance(m, FusedSiLUMulMLP) for m in model.modules()) == 2
    ids = torch.tensor(random_prompts([12], seed=3), device=DEVICE)
    with torch.no_grad():
        want = ref(ids).logits
        got = model(ids).logits
    assert rel_err(got, want) < 1e-5, (arch, rel_err(got, want))


def test_swap_leaves_other_modules_alone() -> None:
    """Gemma-2's ``1 + w`` norms and GELU MLPs and a non-SiLU Llama MLP stay as they are."""
    _, gemma = _pair("gemma2", torch.float32)
    before = [type(m) for m in gemma.modules()]
    assert swap_fused_modules(gemma) == {"rms_norm": 0, "silu_mul": 0}
    assert [type(m) for m in gemma.modules()] == before
    _, gelu = _pair("llama", torch.float32, hidden_act="gelu")
    assert swap_fused_modules(gelu) == {"rms_norm": 5, "silu_mul": 0}
    assert type(gelu.model.layers[0].mlp).__name__ == "LlamaMLP"


def test_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = torch.device("cuda")
    monkeypatch.delenv(FUSED_KERNELS_ENV, raising=False)
    assert fused_kernels_disabled_reason(cuda) is None
    reason = fused_kernels_disabled_reason(torch.device("cpu"))
    assert reason is not None and "CUDA" in reason
    monkeypatch.setenv(FUSED_KERNELS_ENV, "0")
    reason = fused_kernels_disabled_reason(cuda)
    assert reason is not None and FUSED_KERNELS_ENV in reason


def test_engine_on_cpu_keeps_transformers_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedcore import LLM

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the usual CPU backend choice
    eng = random_model(tiny_config("llama"), dtype=torch.float32, device=torch.device("cpu"))
    llm = LLM(eng, device="cpu", block_size=4, max_model_len=48, max_num_batched_tokens=32)
    runner: Any = llm.runner
    assert runner.fused_kernels == {} and "CUDA" in runner.fused_kernels_disabled_reason
    assert not any(isinstance(m, FusedRMSNorm) for m in eng.modules())


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize(("arch", "expected_swaps"), [
    # Qwen3 keeps its attention (q/k norms): no rotary / qkv swap.
    ("qwen3", {"rms_norm": 9, "silu_mul": 2, "gate_up": 2, "rotary": 0, "qkv": 0,
               "add_rms_norm": 2}),
    ("llama", {"rms_norm": 5, "silu_mul": 2, "gate_up": 2, "rotary": 2, "qkv": 2,
               "add_rms_norm": 2}),
])
def test_engine_swaps_on_cuda_and_matches_unswapped_bf16(
    monkeypatch: pytest.MonkeyPatch, arch: str, expected_swaps: dict[str, int]
) -> None:
    """The engine swaps every GPU-checked kind on CUDA by default (and with the switch at 1
    every kind, down_add too); bf16 greedy tokens and log-probabilities agree with the engine
    with the swap turned off by the environment switch."""
    from pagedcore import LLM, SamplingParams

    config = tiny_config(arch, hidden_size=128, head_dim=64, num_attention_heads=4,
                         num_key_value_heads=2)
    prompts = random_prompts([7, 40, 100], seed=9)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    runs = []
    # unset: the default, the GPU-checked kinds; "1": every kind (down_add too); "0": none
    for setting in (None, "1", "0"):
        if setting is None:
            monkeypatch.delenv(FUSED_KERNELS_ENV, raising=False)
        else:
            monkeypatch.setenv(FUSED_KERNELS_ENV, setting)
        model = random_model(config, dtype=torch.bfloat16, device=DEVICE, seed=0)
        _randomise_norms(model)
        llm = LLM(model, device="cuda", dtype="bfloat16", block_size=16, max_model_len=256,
                  kv_cache_memory_bytes=64 << 20)
        runner: Any = llm.runner
        expected = {None: expected_swaps, "1": {**expected_swaps, "down_add": 2}, "0": {}}
        assert runner.fused_kernels == expected[setting], runner.fused_kernels_disabled_reason
        runs.append(llm.generate(prompts, params))
    for fused_run in runs[:2]:
        for fused, plain in zip(fused_run, runs[2], strict=True):
            assert fused.outputs[0].token_ids[:2] == plain.outputs[0].token_ids[:2]
            lp_f, lp_p = fused.outputs[0].logprobs[0], plain.outputs[0].logprobs[0]
            for token, value in lp_f.items():
                if token in lp_p:
                    assert abs(value - lp_p[token]) < 0.1, (token, value, lp_p[token])
