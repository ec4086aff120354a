"""The host side of an eager decode step with the fused modules (the GPU's eager path, issue
22): how many torch ops each layer dispatches, and that the token-major fast path of
`FusedAttention` gives the outputs of transformers' attention interface.

Runs on the CPU with the fused Triton kernels and the triton backend in Triton's interpreter
(forced on: the engine swaps the fused modules in on CUDA only); the ops the interpreter runs
to execute a kernel are not counted (on the GPU a launch is one launch).
"""

from __future__ import annotations

import collections
import importlib.util
import os
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import
if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton", allow_module_level=True)

from engine_helpers import make_models, random_prompts

from pagedcore import LLM, SamplingParams
from pagedcore.engine.models import attention_hook, fused_ops

#: Torch ops one decoder layer of an eager decode step may dispatch (32 measured with the
#: token-major fast path; 6 transposes more before it: docs/benchmarks/eager_host_cpu.md).
OPS_PER_LAYER_BUDGET = 34


class _CountOps(TorchDispatchMode):
    """Counts the aten ops dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _fused_llm(monkeypatch: pytest.MonkeyPatch, layers: int) -> tuple[LLM, int]:
    import triton.runtime.interpreter as interpreter
    from torch.utils._python_dispatch import _disable_current_modes

    monkeypatch.setattr(fused_ops, "fused_kernels_disabled_reason", lambda device: None)
    real_run = interpreter.InterpretedFunction.run

    def run_uncounted(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _disable_current_modes():
            return real_run(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", run_uncounted)
    _config, _ref, eng = make_models("qwen2", num_hidden_layers=layers, hidden_size=128,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    llm = LLM(eng, device="cpu", backend="triton", block_size=16, max_model_len=128,
              kv_cache_memory_bytes=1 << 20)
    assert llm.runner.fused_kernels.get("rotary") == layers, llm.runner.fused_kernels
    return llm, layers


def _decode_ops(llm: LLM, steps: int = 2) -> collections.Counter[str]:
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(random_prompts([7, 12, 5])):
        llm.add_request(str(i), prompt, params)
    for _ in range(3):  # prefill, then decodes
        llm.step()
    counter = _CountOps()
    with counter:
        for _ in range(steps):
            llm.step()
    return collections.Counter({k: v // steps for k, v in counter.ops.items()})


def test_eager_decode_layer_dispatches_few_torch_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per layer, the ops of a step with 4 layers minus those of a step with 2, halved: within
    the budget, and no transposes or copies (the q/k/v heads stay token-major from the
    rotary kernel to the backend; transformers' interface transposed them to [1, H, T, D]
    and back, 6 ops a layer)."""
    small, _ = _fused_llm(monkeypatch, 2)
    big, _ = _fused_llm(monkeypatch, 4)
    ops2, ops4 = _decode_ops(small), _decode_ops(big)
    per_layer = (sum(ops4.values()) - sum(ops2.values())) / 2
    assert per_layer <= OPS_PER_LAYER_BUDGET, (per_layer, ops4 - ops2)
    assert ops4["aten.transpose.int"] == 0, ops4
    assert ops4["aten.clone.default"] == ops2["aten.clone.default"], (ops2, ops4)


def test_token_major_fast_path_matches_the_attention_interface(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused modules' direct call gives the greedy tokens of the interface route (the
    fast path turned off by making the module see another implementation name)."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = random_prompts([9, 4])
    fast, _ = _fused_llm(monkeypatch, 2)
    calls: list[int] = []
    real = attention_hook.paged_attention_tokens

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    from pagedcore.engine.models import fused_attention

    monkeypatch.setattr(fused_attention, "paged_attention_tokens", counting)
    got = [o.outputs[0].token_ids for o in fast.generate(prompts, params)]
    direct = len(calls)
    assert direct > 0
    slow, _ = _fused_llm(monkeypatch, 2)
    monkeypatch.setattr(fused_attention, "ATTN_IMPLEMENTATION", "not-pagedcore")
    calls.clear()
    want = [o.outputs[0].token_ids for o in slow.generate(prompts, params)]
    assert got == want
    # The interface route reaches the same token-major core through pagedcore_attention.
    assert not calls


def test_triton_layers_check_their_inputs_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A triton layer validates its cache and query dtype on first use, not on every call
    (the cache write and the attention of every step); another cache is checked again and a
    wrong one still refused."""
    from pagedcore_triton.impl import TritonAttentionImpl

    llm, layers = _fused_llm(monkeypatch, 2)
    calls: list[int] = []
    real = TritonAttentionImpl._check_inputs

    def counting(self: Any, query: torch.Tensor, kv_cache: torch.Tensor) -> None:
        calls.append(1)
        real(self, query, kv_cache)

    monkeypatch.setattr(TritonAttentionImpl, "_check_inputs", counting)
    _decode_ops(llm)  # prefill and 4 decode steps
    assert len(calls) == layers, calls
    binding = llm.runner.layers[0]
    q = torch.zeros(1, 2, 64)
    bad = torch.zeros(2, 4, 16, 3, 64)  # 3 KV heads, the layer has 1
    with pytest.raises(ValueError, match="kv_cache has shape"):
        binding.impl.do_kv_cache_update(q[:, :1], q[:, :1], bad, torch.zeros(1, dtype=torch.long))
    assert len(calls) == layers + 1
