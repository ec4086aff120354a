"""Prompts with no cached context handed to triton's Hopper prefill kernel through the
metadata builder (`pagedcore_cuda_paged.handoff`): the planning, and whole mixed steps on CPU
(`FakeOps` for cuda_paged's kernels, the Hopper kernel in Triton's interpreter) against the
reference, including a layer the Hopper kernel does not serve (ALiBi: cuda_paged's prefill
runs the handed-off tiles)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():  # before triton is first imported (see triton's conftest)
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("pagedcore_triton")

from check_gpu import run_case
from fake_ops import FakeOps
from pagedcore_cuda_paged import CudaPagedBackend
from pagedcore_cuda_paged.handoff import PREFILL_ENV, handoff_reason, handoff_runs

from pagedcore.attention import CommonAttentionMetadata
from pagedcore.kv_cache.spec import FullAttentionSpec

CUDA = torch.cuda.is_available()
# A decode, two fresh prompts, a chunk over a cached context, a fresh prompt.
REQS = [(16, 1), (0, 40), (0, 23), (33, 16), (0, 17)]


def test_handoff_runs() -> None:
    assert handoff_runs([1, 40, 23, 16, 17], [17, 40, 23, 49, 17]) == [(1, 3), (4, 5)]
    assert handoff_runs([1, 1], [5, 9]) == []
    assert handoff_runs([8, 2], [8, 2]) == [(0, 2)]


def test_handoff_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=128, dtype="bfloat16")
    monkeypatch.setenv(PREFILL_ENV, "own")
    assert handoff_reason(spec, torch.device("cpu")) == f"{PREFILL_ENV}=own"
    monkeypatch.setenv(PREFILL_ENV, "auto")
    assert "compute capability" in (handoff_reason(spec, torch.device("cpu")) or "")
    monkeypatch.setenv(PREFILL_ENV, "triton")
    assert handoff_reason(spec, torch.device("cpu")) is None
    odd = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=80, dtype="bfloat16")
    assert "head size 80" in (handoff_reason(odd, torch.device("cpu")) or "")
    monkeypatch.setenv(PREFILL_ENV, "sometimes")
    with pytest.raises(ValueError, match=PREFILL_ENV):
        handoff_reason(spec, torch.device("cpu"))


def test_builder_hands_off_fresh_prompts_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PREFILL_ENV, "triton")
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float32")
    builder = CudaPagedBackend.get_builder_cls()(spec, ["l"], torch.device("cpu"))
    qs = [q for _, q in REQS]
    seqs = [c + q for c, q in REQS]
    qsl = torch.tensor([0, *torch.tensor(qs).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seqs, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=lens, seq_lens_cpu=lens,
        num_reqs=len(REQS), num_actual_tokens=int(qsl[-1]), max_query_len=max(qs),
        max_seq_len=max(seqs), block_table=torch.zeros((len(REQS), 4), dtype=torch.int32),
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64),
        positions=torch.zeros(int(qsl[-1]), dtype=torch.int64))
    meta = builder.build(common)
    assert [(p.req_begin, p.req_end, p.token_begin, p.token_end) for p in meta.handoff_parts] \
        == [(1, 3, 1, 64), (4, 5, 80, 97)]
    assert all(p.tma_prefill and not p.has_context for p in meta.handoff_parts)
    assert {int(r) for r in meta.prefill_tiles[:, 0]} == {3}
    assert meta.handoff_tiles is not None
    assert {int(r) for r in meta.handoff_tiles[:, 0]} == {1, 2, 4}
    monkeypatch.setenv(PREFILL_ENV, "own")
    own = CudaPagedBackend.get_builder_cls()(spec, ["l"], torch.device("cpu")).build(common)
    assert own.handoff_parts == () and own.handoff_tiles is None
    assert {int(r) for r in own.prefill_tiles[:, 0]} == {1, 2, 3, 4}


@pytest.mark.skipif(CUDA, reason="FakeOps stand in for the extension on CPU")
@pytest.mark.parametrize("alibi", [False, True], ids=["hopper", "alibi_falls_back"])
def test_mixed_step_with_handoff_matches_reference(
    fake_ops: FakeOps, monkeypatch: pytest.MonkeyPatch, alibi: bool
) -> None:
    import pagedcore_triton.ops_tma as ops_tma

    monkeypatch.setenv(PREFILL_ENV, "triton")
    launches: list[Any] = []
    real = ops_tma.run_tma

    def spy(launch: Any, *args: Any, **kwargs: Any) -> None:
        launches.append(launch.grid)
        real(launch, *args, **kwargs)

    monkeypatch.setattr(ops_tma, "run_tma", spy)
    err = run_case(torch.float32, 64, 16, 2, 2, window=None, alibi=alibi, cap=None,
                   force=None, seed=5, device="cpu", reqs=REQS)
    assert err <= 1e-3, err
    prefills = [c for c in fake_ops.calls if c[0] == "prefill"]
    assert len(launches) == (0 if alibi else 2), launches
    assert len(prefills) == (2 if alibi else 1), fake_ops.calls


def test_capability_table_says_so() -> None:
    from pagedcore.plugins.cli import _features, _short_row

    assert "prefill:triton" in _features(CudaPagedBackend)
    row = {"name": "cuda_paged", "priority": 30, "devices": ["cuda"], "dtypes": ["float16"],
           "head_sizes": [64], "block_sizes": ["16"], "unavailable_reason": None,
           "features": _features(CudaPagedBackend)}
    assert "pf:triton" in _short_row(row)[6]
