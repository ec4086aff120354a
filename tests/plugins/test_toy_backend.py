"""The third-party example in docs/examples/toy_backend: discovered, correct, honest."""

from __future__ import annotations

import math
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch

import pagedcore
from pagedcore.attention import CommonAttentionMetadata
from pagedcore.kv_cache.spec import FullAttentionSpec
from pagedcore.plugins.registry import BackendRegistry

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "toy_backend"
try:
    import pagedcore_toy_sdpa
except ImportError:  # not pip-installed: use the source tree
    sys.path.insert(0, str(EXAMPLE))
    import pagedcore_toy_sdpa

ToySdpaBackend = pagedcore_toy_sdpa.ToySdpaBackend


def _installed() -> bool:
    eps = metadata.entry_points(group="pagedcore.backends")
    return any(ep.name == "toy_sdpa" for ep in eps)


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 causal attention of q ``[q_len, Hq, D]`` over k/v ``[S, Hkv, D]`` (end-aligned)."""
    q_len, hq, _ = q.shape
    s_len, hkv, _ = k.shape
    out = torch.zeros(q_len, hq, q.shape[2], dtype=torch.float64)
    for h in range(hq):
        kh = h // (hq // hkv)
        for i in range(q_len):
            pos = s_len - q_len + i
            scores = (k[: pos + 1, kh].double() @ q[i, h].double()) * scale
            out[i, h] = torch.softmax(scores, 0) @ v[: pos + 1, kh].double()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_dense_formula_on_permuted_poisoned_cache(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    hq, hkv, d, bsz, num_blocks = 6, 2, 16, 4, 24
    contexts, query_lens = [0, 5, 9], [7, 1, 3]  # prefill, decode, chunked prefill
    seq_lens = [c + q for c, q in zip(contexts, query_lens, strict=True)]
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0 is null
    tables = []
    for s in seq_lens:
        n = math.ceil(s / bsz)
        tables.append(perm[:n])
        perm = perm[n:]
    impl = ToySdpaBackend.get_impl_cls()(hq, d, d**-0.5, num_kv_heads=hkv)
    cache = torch.full(ToySdpaBackend.get_kv_cache_shape(num_blocks, bsz, hkv, d), math.nan,
                       dtype=dtype)
    ks = [torch.randn(s, hkv, d, generator=gen).to(dtype) for s in seq_lens]
    vs = [torch.randn(s, hkv, d, generator=gen).to(dtype) for s in seq_lens]
    qs = [torch.randn(q, hq, d, generator=gen).to(dtype) for q in query_lens]

    def slots(r: int, lo: int, hi: int) -> list[int]:
        return [tables[r][p // bsz] * bsz + p % bsz for p in range(lo, hi)]

    # history first, then this step's tokens plus two -1 padding tokens
    hist = [r for r, c in enumerate(contexts) if c]
    impl.do_kv_cache_update(torch.cat([ks[r][: contexts[r]] for r in hist]),
                            torch.cat([vs[r][: contexts[r]] for r in hist]), cache,
                            torch.tensor([s for r in hist for s in slots(r, 0, contexts[r])]))
    pad = torch.full((2, hkv, d), math.nan, dtype=dtype)
    new_k = torch.cat([*(k[c:] for k, c in zip(ks, contexts, strict=True)), pad])
    new_v = torch.cat([*(v[c:] for v, c in zip(vs, contexts, strict=True)), pad])
    slot_mapping = [s for r in range(3) for s in slots(r, contexts[r], seq_lens[r])] + [-1, -1]
    qsl = torch.tensor([0, 7, 8, 11], dtype=torch.int32)
    table = torch.zeros(3, 4, dtype=torch.int32)
    for r, t in enumerate(tables):
        table[r, : len(t)] = torch.tensor(t)
    seq_cpu = torch.tensor(seq_lens, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq_cpu, seq_lens_cpu=seq_cpu,
        num_reqs=3, num_actual_tokens=11, max_query_len=7, max_seq_len=max(seq_lens),
        block_table=table, slot_mapping=torch.tensor(slot_mapping),
        positions=torch.zeros(13, dtype=torch.int64),
    )
    impl.do_kv_cache_update(new_k, new_v, cache, common.slot_mapping)
    spec = FullAttentionSpec(block_size=bsz, num_kv_heads=hkv, head_size=d, dtype=dtype)
    plan = ToySdpaBackend.get_builder_cls()(spec, ["layer.0"], torch.device("cpu")).build(common)
    query = torch.cat([*qs, torch.full((2, hq, d), math.nan, dtype=dtype)])
    out = impl.forward(query, new_k, new_v, cache, plan)

    assert out.shape == query.shape and out.dtype == dtype
    ref = torch.cat([_dense(q, k, v, d**-0.5) for q, k, v in zip(qs, ks, vs, strict=True)])
    got = out[:11].double()
    assert not got.isnan().any()
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    assert rel < (1e-5 if dtype == torch.float32 else 2e-2), f"max relative error {rel:.2e}"


def test_declares_only_what_it_implements() -> None:
    b = ToySdpaBackend
    assert not (b.supports_sliding_window or b.supports_alibi or b.supports_logits_soft_cap
                or b.supports_mla)
    assert b.supported_kv_cache_dtypes == ("auto",)
    with pytest.raises(NotImplementedError, match="full attention only"):
        b.get_impl_cls()(4, 16, 0.25, sliding_window=8)
    with pytest.raises(ValueError, match="kv_cache_dtype 'auto'"):
        b.get_kv_cache_shape(4, 16, 2, 64, "fp8_e4m3")


def test_passes_the_conformance_suite_quick() -> None:
    runner = pytest.importorskip("pagedcore.conformance.runner")
    report = runner.run_suite(ToySdpaBackend, quick=True, device="cpu")
    assert report.passed, report.summary()


@pytest.mark.skipif(not _installed(), reason="pip install docs/examples/toy_backend first")
def test_installed_package_is_discovered_but_never_chosen_automatically() -> None:
    reg = BackendRegistry.from_entry_points(allowlist=["toy_sdpa", "reference"])
    entry = reg.backends["toy_sdpa"]
    assert entry.distribution == "pagedcore-toy-sdpa" and entry.plugin == "toy_sdpa"
    from pagedcore.plugins.registry import isolated_registry

    with isolated_registry(reg):
        cfg = {"head_size": 64, "dtype": "float32", "block_size": 16, "device": "cpu"}
        assert pagedcore.select_backend(**cfg).name == "reference"
        assert pagedcore.select_backend(**cfg, backend="toy_sdpa") is entry.cls
