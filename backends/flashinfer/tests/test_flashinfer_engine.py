"""The engine end to end through the adapter and the FlashInfer test double, on the CPU: greedy
tokens equal the reference backend's over chunked prefills, decodes and mixed steps."""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any, ClassVar

import fi_double
import pytest
import torch
from pagedcore_flashinfer import fi_api
from test_flashinfer_conformance import _CpuDoubleBackend

import pagedcore
from pagedcore import LLM, AttentionBackend, SamplingParams
from pagedcore.attention.backend import CudaGraphSupport
from pagedcore.engine.models.loading import random_model, tiny_config
from pagedcore.plugins.registry import BackendRegistry, isolated_registry
from pagedcore.reference import plugin as reference_plugin


@pagedcore.hookimpl
def _register() -> Sequence[type[AttentionBackend]]:
    return [_CpuDoubleBackend]


def test_greedy_tokens_match_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fi_api, "load_flashinfer", lambda: fi_double.FakeFlashInfer())
    fi_double.REGISTRY.clear()
    registry = BackendRegistry()
    registry.register_plugin(reference_plugin, name="reference")
    registry.register_plugin(
        types.SimpleNamespace(pagedcore_register_backends=_register), name="double"
    )
    config = tiny_config("llama", head_dim=64, hidden_size=128)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (9, 30, 3)]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    tokens = {}
    with isolated_registry(registry):
        for name in ("reference", _CpuDoubleBackend.name):
            model = random_model(config, dtype=torch.float32, device=torch.device("cpu"), seed=0)
            llm = LLM(model, device="cpu", dtype="float16", block_size=16, max_model_len=64,
                      max_num_batched_tokens=24, backend=name, kv_cache_memory_bytes=1 << 20)
            tokens[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert tokens[_CpuDoubleBackend.name] == tokens["reference"]
    kinds = {w.kind for w in fi_double.REGISTRY if w.runs}
    assert kinds == {"decode", "prefill"}, kinds


class _GraphDouble(_CpuDoubleBackend):
    """The adapter over the double, under its own name, with the flashinfer backend's decode
    graph declaration (confirmed on the H200 by `test_decode_graphs_on_real_flashinfer`)."""

    name: ClassVar[str] = "flashinfer_graph_double"


def test_flashinfer_declares_decode_graphs() -> None:
    from pagedcore_flashinfer import FlashInferBackend

    assert FlashInferBackend.cudagraph_support == CudaGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE
    assert _GraphDouble.cudagraph_support == FlashInferBackend.cudagraph_support


@pagedcore.hookimpl
def _register_graph() -> Sequence[type[AttentionBackend]]:
    return [_GraphDouble]


def graph_registry() -> BackendRegistry:
    """A registry of the reference backend and `_GraphDouble` (for `isolated_registry`)."""
    registry = BackendRegistry()
    registry.register_plugin(reference_plugin, name="reference")
    registry.register_plugin(
        types.SimpleNamespace(pagedcore_register_backends=_register_graph), name="double")
    return registry


def _graph_tokens(refresh: bool, monkeypatch: pytest.MonkeyPatch,
                  device: str = "cpu") -> tuple[list[Any], ...]:
    """(eager tokens, decode-graph tokens) of one workload through `_GraphDouble` (the test
    double on CPU with `EagerCapturer`; the real FlashInfer and real graphs on CUDA)."""
    from pagedcore_flashinfer.metadata import FlashInferMetadataBuilder

    from pagedcore.engine.runner.cuda_graph import EagerCapturer

    if not refresh:
        monkeypatch.setattr(FlashInferMetadataBuilder, "prepare_replay", lambda *a: None)
    registry = graph_registry()
    config = tiny_config("llama", head_dim=64, hidden_size=128)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (9, 30, 3, 17, 5)]
    params = [SamplingParams(max_tokens=3 + 3 * i, temperature=0.0, ignore_eos=True)
              for i in range(len(prompts))]
    out = []
    dev = torch.device(device)
    with isolated_registry(registry):
        for graphs in (False, True):
            model = random_model(config, dtype=torch.float32, device=dev, seed=0)
            llm = LLM(model, device=device, dtype="float16", block_size=16, max_model_len=64,
                      max_num_seqs=8, max_num_batched_tokens=24, backend=_GraphDouble.name,
                      kv_cache_memory_bytes=1 << 20, enforce_eager=not graphs)
            capturer = EagerCapturer()
            if graphs and device == "cpu":
                llm.runner.enable_cudagraphs(capturer=capturer, sizes=[1, 2, 4, 8])
            out.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
            if graphs:
                assert llm.cudagraph_status()["enabled"], llm.cudagraph_status()
            if graphs and device == "cpu":
                assert capturer.num_captures == 4 and capturer.num_replays >= 10
    return tuple(out)


def test_decode_graphs_replan_before_each_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode graphs over FlashInfer's use_cuda_graph wrappers (the double's fixed buffers):
    replays give the eager tokens because `prepare_replay` re-plans into the buffers; with it
    disabled the replays read the capture's padding plan and the tokens differ."""
    monkeypatch.setattr(fi_api, "load_flashinfer", lambda: fi_double.FakeFlashInfer())
    fi_double.REGISTRY.clear()
    eager, graphed = _graph_tokens(True, monkeypatch)
    assert graphed == eager
    graph_wrappers = [w for w in fi_double.REGISTRY if getattr(w, "graph", False)]
    assert graph_wrappers and all(w.kwargs["use_tensor_cores"] for w in graph_wrappers)
    assert sum(len(w.plans) for w in graph_wrappers) > len(graph_wrappers)  # re-planned
    eager2, stale = _graph_tokens(False, monkeypatch)
    assert eager2 == eager and stale != eager


def test_decode_graphs_on_real_flashinfer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same on a GPU with FlashInfer: real CUDA graphs over the real graph wrappers (what
    the flashinfer backend's UNIFORM_SINGLE_TOKEN_DECODE rests on; passed on the H200,
    session 11, `docs/benchmarks/h200_s11/round2/graphs.log`)."""
    from pagedcore_flashinfer import FlashInferBackend

    why = FlashInferBackend.is_available()
    if why is not None:
        pytest.skip(f"flashinfer backend unavailable here: {why}")
    monkeypatch.setenv("PAGEDCORE_FLASHINFER_PREFILL", "fa2")  # the prebuilt FA2 modules
    monkeypatch.setattr(_GraphDouble, "supported_devices", ("cuda",))
    eager, graphed = _graph_tokens(True, monkeypatch, device="cuda")
    assert graphed == eager
