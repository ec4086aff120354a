"""The flashinfer backend's fp8 KV cache, through the FlashInfer test double on the CPU.

What the conformance suite's fp8 cases do not reach: the scales are read from the layer's
device tensors at run time (a decode-graph plan made before `set_kv_scales` serves the new
scales without a re-plan, as the engine needs when it calibrates after capturing its graphs),
the cache holds exactly ``quantize_fp8(x, scale)``, an fp8 layer's prefill runs FA2 even when
FA3 is asked for, and the errors for what the backend cannot serve.
"""

from __future__ import annotations

import math

import fi_double
import pytest
import torch
from pagedcore_flashinfer import FlashInferBackend, fi_api
from pagedcore_flashinfer.impl import FlashInferImpl
from pagedcore_flashinfer.metadata import (
    PREFILL_KERNELS_ENV,
    FlashInferMetadataBuilder,
    LayerParams,
)
from test_flashinfer_planning import _common

from pagedcore.attention.kv_quant import kv_cache_torch_dtype, quantize_fp8
from pagedcore.kv_cache.spec import FullAttentionSpec
from pagedcore.reference import ReferenceBackend

HQ, HKV, D, BS, NUM_BLOCKS = 8, 2, 64, 16, 24
#: FlashInfer's own import (the autouse fixture swaps in the double for the CPU tests).
_REAL_LOAD = fi_api.load_flashinfer
#: (history, query) per request: three decodes (the shape a decode graph serves).
DECODES = [(20, 1), (47, 1), (5, 1)]


@pytest.fixture(autouse=True)
def _double(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fi_api, "load_flashinfer", lambda: fi_double.FakeFlashInfer())
    fi_double.REGISTRY.clear()


def _all_slots(requests: list[tuple[int, int]], table: torch.Tensor) -> torch.Tensor:
    """Every position's slot (history and query), request by request."""
    slots = [int(table[b, pos // BS]) * BS + pos % BS
             for b, (ctx, q) in enumerate(requests) for pos in range(ctx + q)]
    return torch.tensor(slots, dtype=torch.int64)


def _impls(kv: str, k_scale: float, v_scale: float) -> tuple[FlashInferImpl, object]:
    kwargs = dict(num_kv_heads=HKV, kv_cache_dtype=kv, k_scale=k_scale, v_scale=v_scale)
    ref = ReferenceBackend.get_impl_cls()(HQ, D, D**-0.5, **kwargs)  # type: ignore[arg-type]
    return FlashInferImpl(HQ, D, D**-0.5, **kwargs), ref  # type: ignore[arg-type]


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_graph_plan_reads_scales_set_after_capture(kv: str) -> None:
    dtype = torch.float16
    fp8 = kv_cache_torch_dtype(kv, dtype)
    common = _common(DECODES, BS, NUM_BLOCKS, seed=5)
    impl, ref_impl = _impls(kv, 0.01, 0.02)
    # NaN in every slot, then the requests' tokens: a read past a request's length shows.
    cache = torch.full((NUM_BLOCKS, 2, BS, HKV, D), float("nan")).to(fp8)
    gen = torch.Generator().manual_seed(0)
    slots = _all_slots(DECODES, common.block_table)
    key = torch.randn(len(slots), HKV, D, generator=gen, dtype=torch.float32).to(dtype)
    value = torch.randn(len(slots), HKV, D, generator=gen, dtype=torch.float32).to(dtype)
    impl.do_kv_cache_update(key, value, cache, slots)
    # The cache holds exactly fp8(x / scale), bit for bit.
    blocks, offsets = slots // BS, slots % BS
    assert torch.equal(cache[blocks, 0, offsets].view(torch.uint8),
                       quantize_fp8(key, 0.01, fp8).view(torch.uint8))
    assert torch.equal(cache[blocks, 1, offsets].view(torch.uint8),
                       quantize_fp8(value, 0.02, fp8).view(torch.uint8))

    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HKV, head_size=D, dtype="float16")
    builder = FlashInferBackend.get_builder_cls()(spec, ["l0"], torch.device("cpu"))
    ref_builder = ReferenceBackend.get_builder_cls()(spec, ["l0"], torch.device("cpu"))
    md = builder.build_for_cudagraph_capture(common)  # planned once, as a captured graph is
    ref_md = ref_builder.build(common)
    ref_cache = cache.transpose(0, 1).contiguous()  # the reference's (2, N, ...) layout
    query = torch.randn(common.num_actual_tokens, HQ, D, generator=gen).to(dtype)

    outs = []
    for k_scale, v_scale in [(0.01, 0.02), (0.03, 0.05)]:
        impl.set_kv_scales(k_scale, v_scale)
        ref_impl.set_kv_scales(k_scale, v_scale)  # type: ignore[attr-defined]
        out = impl.forward(query, query, query, cache, md)
        ref = ref_impl.forward(query, query, query, ref_cache, ref_md)  # type: ignore[attr-defined]
        assert torch.isfinite(out).all()
        rel = float((out.float() - ref.float()).norm() / ref.float().norm())
        assert rel < 2e-3, (k_scale, v_scale, rel)
        outs.append(out)
    assert not torch.allclose(outs[0], outs[1], rtol=0.05)  # the new scales took effect
    graph_wrappers = [w for w in fi_double.REGISTRY if getattr(w, "graph", False)]
    assert len(graph_wrappers) == 1 and len(graph_wrappers[0].plans) == 1  # no re-plan
    assert graph_wrappers[0].plans[0]["kv_dtype"] == fp8


def test_fp8_prefill_runs_fa2_when_fa3_is_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PREFILL_KERNELS_ENV, "fa3")
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HKV, head_size=D, dtype="bfloat16")
    builder = FlashInferBackend.get_builder_cls()(spec, ["l0"], torch.device("cpu"))
    assert isinstance(builder, FlashInferMetadataBuilder)

    def params(kv_dtype: torch.dtype) -> LayerParams:
        return LayerParams(num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, window_left=-1,
                           logits_soft_cap=None, sm_scale=D**-0.5, q_dtype=torch.bfloat16,
                           kv_dtype=kv_dtype)

    assert builder.prefill_backend(params(torch.bfloat16)) == "fa3"
    assert builder.prefill_backend(params(torch.float8_e4m3fn)) == "fa2"
    assert builder.prefill_backend(params(torch.float8_e5m2)) == "fa2"
    # A whole prefill step on the fp8 cache: the double rejects FA3 with fp8 K/V, as FlashInfer
    # does, so this passing means FA2 was asked for.
    impl = FlashInferImpl(HQ, D, D**-0.5, num_kv_heads=HKV, kv_cache_dtype="fp8")
    common = _common([(0, 9), (16, 4)], BS, NUM_BLOCKS, seed=1)
    cache = torch.zeros(NUM_BLOCKS, 2, BS, HKV, D, dtype=torch.float8_e4m3fn)
    query = torch.randn(common.num_actual_tokens, HQ, D, dtype=torch.bfloat16)
    out = impl.forward(query, query, query, cache, builder.build(common))
    assert torch.isfinite(out).all()
    prefill = [w for w in fi_double.REGISTRY if w.kind == "prefill"]
    assert [w.kwargs.get("backend") for w in prefill] == ["fa2"]


def test_fp8_declarations_and_errors() -> None:
    assert FlashInferBackend.supported_kv_cache_dtypes == ("auto", "fp8_e4m3", "fp8_e5m2")
    assert FlashInferBackend.get_kv_cache_shape(4, 16, 2, 64, "fp8") == (4, 2, 16, 2, 64)
    with pytest.raises(ValueError, match="'int8' is not one of"):
        FlashInferBackend.get_kv_cache_shape(4, 16, 2, 64, "int8")
    with pytest.raises(ValueError, match="attention sinks"):
        FlashInferImpl(HQ, D, D**-0.5, num_kv_heads=HKV, sinks=[0.0] * HQ)
    impl = FlashInferImpl(HQ, D, D**-0.5, num_kv_heads=HKV, kv_cache_dtype="fp8_e5m2")
    wrong = torch.zeros(NUM_BLOCKS, 2, BS, HKV, D, dtype=torch.float8_e4m3fn)
    kv = torch.zeros(1, HKV, D, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"allocate the cache in torch\.float8_e5m2"):
        impl.do_kv_cache_update(kv, kv, wrong, torch.tensor([17]))


#: The top-1 / top-2 log-probability gap under which an fp8 cache may swap the two against a
#: 16-bit cache (e5m2 has one mantissa bit less). Twice tests/engine/test_fp8_kv_engine.py's:
#: this model computes in fp16, with twice its hidden size; a swap at 0.104 nats was seen.
MARGIN = {"fp8_e4m3": 0.2, "fp8_e5m2": 0.4}
#: The same between two engines reading the same fp8 cache (only their fp16 arithmetic differs).
SAME_CACHE_MARGIN = 0.05


def _engine_logprobs(
    kv: str, device: str, backend: str
) -> tuple[list[list[int]], list[list[dict[int, float]]]]:
    """Greedy tokens and every step's full distribution of one workload (tiny Llama, fp16,
    initializer_range 0.1). On the flashinfer adapter decode steps run as graphs (EagerCapturer
    over the double on the CPU; real CUDA graphs over real FlashInfer on a GPU), captured before
    the first prefill calibrates the fp8 scales; the reference backend runs eagerly."""
    from test_flashinfer_engine import _GraphDouble, graph_registry

    from pagedcore import LLM, SamplingParams
    from pagedcore.engine.models.loading import random_model, tiny_config
    from pagedcore.engine.runner.cuda_graph import EagerCapturer
    from pagedcore.plugins.registry import isolated_registry

    registry = graph_registry()
    config = tiny_config("llama", head_dim=64, hidden_size=128)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist()
               for n in (9, 30, 3, 17, 41, 12, 25, 6)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=128)
    graphs = backend == "flashinfer"
    with isolated_registry(registry):
        model = random_model(config, dtype=torch.float32, device=torch.device(device), seed=0)
        llm = LLM(model, device=device, dtype="float16", block_size=16, max_model_len=64,
                  max_num_seqs=8, max_num_batched_tokens=24,
                  backend=_GraphDouble.name if graphs else backend, enforce_eager=not graphs,
                  kv_cache_memory_bytes=1 << 20, kv_cache_dtype=kv, max_logprobs=128)
        capturer = EagerCapturer()
        if graphs and device == "cpu":
            llm.runner.enable_cudagraphs(capturer=capturer, sizes=[1, 2, 4, 8])
        if graphs:
            assert llm.cudagraph_status()["enabled"], llm.cudagraph_status()
        outs = llm.generate(prompts, params)
        if graphs and device == "cpu":
            assert capturer.num_replays >= 5
        if kv != "auto":
            assert llm.stats()["kv_scales"]["source"] == "first prefill"
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    dists = [[{t: float(v) for t, v in step.items()} for step in (o.outputs[0].logprobs or [])]
             for o in outs]
    return tokens, dists


def _divergence(margin: float, ref: tuple[list[list[int]], list[list[dict[int, float]]]],
                other: tuple[list[list[int]], list[list[dict[int, float]]]]) -> float:
    """Mean KL(ref || other) in nats over each request's positions up to the first token
    that differs (where the histories part); a differing token must be a near-tie of ref's."""
    kls = []
    for r_tok, q_tok, r_steps, q_steps in zip(ref[0], other[0], ref[1], other[1], strict=True):
        for r_t, q_t, r, q in zip(r_tok, q_tok, r_steps, q_steps, strict=True):
            kls.append(sum(math.exp(lp) * (lp - q[t]) for t, lp in r.items()))
            if r_t != q_t:
                top2 = sorted(r.values(), reverse=True)[:2]
                assert top2[0] - top2[1] <= margin, (r_t, q_t, top2)
                break  # the histories differ from here on: nothing left to compare
    assert len(kls) >= 24, len(kls)
    return sum(kls) / len(kls)


def _compare_fp8_engine(kv: str, device: str) -> None:
    """The adapter's fp8 engine against the 16-bit cache and against the oracle's fp8 engine.

    The bound is the oracle's own: the reference backend on the same fp8 cache (same scales,
    same quantization) gives KL(16-bit || fp8) = k_ref, and the adapter may lose no more than
    that (x 1.5 + 1e-4 for the two engines' fp16 arithmetic); against the oracle's fp8 run its
    KL must be an order below. A dropped scale, a stale graph scale or a misread fp8 cache
    moves either by orders of magnitude. (This model's k_ref on the CPU: ~2.5e-3 e4m3, ~7e-3 e5m2.)
    """
    ref16 = _engine_logprobs("auto", device, "flashinfer")
    fi8 = _engine_logprobs(kv, device, "flashinfer")
    ref8 = _engine_logprobs(kv, device, "reference")
    k_ref = _divergence(MARGIN[kv], ref16, ref8)
    k_fi = _divergence(MARGIN[kv], ref16, fi8)
    assert k_fi <= 1.5 * k_ref + 1e-4, (k_fi, k_ref)
    assert _divergence(SAME_CACHE_MARGIN, ref8, fi8) <= 0.1 * k_ref + 1e-4, (k_ref,)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_engine_fp8_through_the_double_with_decode_graphs(kv: str) -> None:
    _compare_fp8_engine(kv, "cpu")


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_engine_fp8_on_real_flashinfer(kv: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same on a GPU: real FlashInfer FA2 kernels over an fp8 cache, real decode graphs
    captured before the first prefill calibrates the scales."""
    from test_flashinfer_engine import _GraphDouble

    why = FlashInferBackend.is_available()
    if why is not None:
        pytest.skip(f"flashinfer backend unavailable here: {why}")
    monkeypatch.setattr(_GraphDouble, "supported_devices", ("cuda",))
    monkeypatch.setattr(fi_api, "load_flashinfer", _REAL_LOAD)  # not the autouse double
    # The 16-bit run's prefill on FA2 too: the modules `tools/prebuild_jit.py` builds for it.
    monkeypatch.setenv(PREFILL_KERNELS_ENV, "fa2")
    _compare_fp8_engine(kv, "cuda")
