"""The reference backend's fp8 KV cache and attention sinks against a dense oracle."""

from __future__ import annotations

import pytest
import torch

from pagedcore.attention.kv_quant import dequantize_fp8, kv_cache_torch_dtype, quantize_fp8
from pagedcore.conformance.cases import CaseSpec
from pagedcore.conformance.harness import (
    FP8_SCALES,
    Batch,
    make_batch,
    run_backend,
    sink_logits,
    softmax_scale,
)
from pagedcore.reference import ReferenceBackend


def _dense(batch: Batch, case: CaseSpec, keys: list[torch.Tensor],
           values: list[torch.Tensor]) -> torch.Tensor:
    """Per request: scores, causal (and window) mask, a sink column, softmax, drop the sink."""
    outs = []
    group = case.num_heads // case.num_kv_heads
    sinks = torch.tensor(sink_logits(case.num_heads)) if case.sinks else None
    for q, k, v, ctx in zip(batch.queries, keys, values, batch.contexts, strict=True):
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", q, k) * softmax_scale(case.head_size)
        pos_q = ctx + torch.arange(q.shape[0])[:, None]
        pos_k = torch.arange(k.shape[0])[None, :]
        mask = pos_k <= pos_q
        if case.sliding_window is not None:
            mask &= pos_q - pos_k < case.sliding_window
        s = s.masked_fill(~mask, float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.view(-1, 1, 1).expand(-1, q.shape[0], 1)], dim=-1)
        p = torch.softmax(s, dim=-1)[..., : k.shape[0]]
        outs.append(torch.einsum("hqk,khd->qhd", p, v))
    return torch.cat(outs)


def _case(**kw: object) -> CaseSpec:
    spec: dict[str, object] = {"name": "t", "batch": "chunked_prefill", "dtype": "float32",
                               "head_size": 32, "block_size": 16, "num_heads": 8,
                               "num_kv_heads": 2}
    spec.update(kw)
    return CaseSpec(**spec)  # type: ignore[arg-type]


def _run(case: CaseSpec) -> tuple[torch.Tensor, Batch]:
    batch = make_batch(case, 1)
    out = run_backend(ReferenceBackend, case, batch, device=torch.device("cpu"),
                      dtype=torch.float32, block_ids=batch.block_ids,
                      num_blocks=batch.num_blocks)[0]
    return out[: sum(batch.query_lens)], batch


@pytest.mark.parametrize("window", [None, 5])
def test_sinks_join_the_denominator(window: int | None) -> None:
    case = _case(sinks=True, sliding_window=window, batch="mixed")
    out, batch = _run(case)
    ref = _dense(batch, case, batch.keys, batch.values)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    # The sinks matter: without them the oracle differs by far more than the tolerance.
    plain = _dense(batch, _case(sliding_window=window, batch="mixed"), batch.keys, batch.values)
    assert (plain - ref).abs().max() > 0.05


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_cache_reads_back_what_it_stored(kv: str) -> None:
    case = _case(kv_cache_dtype=kv, sinks=True)
    out, batch = _run(case)
    fp8 = kv_cache_torch_dtype(kv, torch.float32)
    ks, vs = FP8_SCALES
    keys = [dequantize_fp8(quantize_fp8(k, ks, fp8), ks) for k in batch.keys]
    values = [dequantize_fp8(quantize_fp8(v, vs, fp8), vs) for v in batch.values]
    ref = _dense(batch, case, keys, values)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    # ... and that differs from the unquantized result by about fp8's precision.
    exact = _dense(batch, case, batch.keys, batch.values)
    err = float((exact - ref).abs().max() / exact.abs().max())
    assert 1e-3 < err < (0.1 if kv == "fp8_e4m3" else 0.2)


def test_quantize_saturates_instead_of_overflowing() -> None:
    x = torch.tensor([1e6, -1e6, 3.0, 0.0])
    q = quantize_fp8(x, 2.0, torch.float8_e4m3fn)
    assert q.float().tolist() == [448.0, -448.0, 1.5, 0.0]
    assert torch.isfinite(quantize_fp8(x, 1.0, torch.float8_e5m2).float()).all()


def test_fp8_impl_rejects_a_model_dtype_cache_mismatch() -> None:
    impl = ReferenceBackend.get_impl_cls()(2, 16, 0.25, kv_cache_dtype="auto")
    cache = torch.zeros(2, 2, 16, 2, 16, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="kv_cache_dtype 'auto'"):
        impl.do_kv_cache_update(torch.zeros(1, 2, 16), torch.zeros(1, 2, 16), cache,
                                torch.tensor([0]))


def test_impl_arguments_are_checked() -> None:
    cls = ReferenceBackend.get_impl_cls()
    with pytest.raises(ValueError, match="sinks has 3 entries"):
        cls(4, 16, 0.25, sinks=[0.0, 1.0, 2.0])
    with pytest.raises(ValueError, match="k_scale must be a positive finite"):
        cls(4, 16, 0.25, kv_cache_dtype="fp8", k_scale=float("nan"))
    with pytest.raises(ValueError, match="v_scale must be a positive finite"):
        cls(4, 16, 0.25, kv_cache_dtype="fp8", v_scale=0.0)
    impl = cls(4, 16, 0.25, kv_cache_dtype="fp8", sinks=torch.arange(4.0))
    assert impl.kv_cache_dtype == "fp8_e4m3" and impl.sinks == [0.0, 1.0, 2.0, 3.0]
    k, v = impl.kv_scales_on(torch.device("cpu"))
    impl.set_kv_scales(0.5, 0.25)
    assert (float(k), float(v)) == (0.5, 0.25)  # updated in place
