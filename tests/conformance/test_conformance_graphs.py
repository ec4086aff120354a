"""The graph-plan cases (`pagedcore.conformance.graphs`): backends keeping the CUDA-graph
planning contract pass them, each planted way of breaking it fails them, and backends without
the capability get none."""

from __future__ import annotations

import os
from typing import Any, ClassVar

import pytest
import torch

if not torch.cuda.is_available():  # triton runs on CPU tensors in its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from broken_graph_backends import (
    BROKEN_DECODE,
    CaptureRaises,
    GraphSafeReference,
    LiveGraphImpl,
    SnapshotsSeqLens,
    triton_without_cascade_refresh,
)
from click.testing import CliRunner

from pagedcore.attention.backend import (
    AttentionImpl,
    CudaGraphSupport,
    MetadataBuilder,
)
from pagedcore.conformance import run_suite
from pagedcore.conformance.cli import conformance
from pagedcore.conformance.graphs import BUCKET, MIXED_TOKENS, graph_capacity, graph_steps
from pagedcore.conformance.runner import list_graph_cases
from pagedcore.reference import ReferenceBackend
from pagedcore.reference.metadata import ReferenceMetadataBuilder

pytest_plugins = ["pytester"]

QUICK_NAMES = ["graph/decode/float32/hs32/bs16/h8kv2", "graph/cascade/float32/hs32/bs16/h8kv2"]


def _triton() -> Any:
    from pagedcore_triton import TritonAttentionBackend

    why = TritonAttentionBackend.is_available()
    if why is None and _device() not in TritonAttentionBackend.supported_devices:
        why = "TRITON_INTERPRET was not set before triton was imported"
    if why is not None:
        pytest.skip(f"triton cannot run here: {why}")
    return TritonAttentionBackend


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def test_graph_safe_backend_passes_every_graph_case() -> None:
    quick = run_suite(GraphSafeReference, quick=True, device="cpu", case_filter="graph/")
    assert [r.name for r in quick.results] == QUICK_NAMES
    assert quick.passed, quick.summary()
    full = run_suite(GraphSafeReference, device="cpu", case_filter="graph/")
    names = [r.name for r in full.results]
    for part in ("float16", "bfloat16", "/bs1/", "window19", "alibi", "softcap2", "sinks",
                 "fp8_e4m3"):
        assert any(part in n for n in names if n.startswith("graph/decode/")), part
    # The engine never cascades windowed layers.
    assert not any("window" in n for n in names if n.startswith("graph/cascade/"))
    assert full.passed, full.summary()


def test_backends_without_the_capability_get_no_graph_cases() -> None:
    for quick in (True, False):
        assert list_graph_cases(ReferenceBackend, quick=quick) == []
    report = run_suite(ReferenceBackend, quick=True, device="cpu")
    assert report.passed and not any(r.name.startswith("graph/") for r in report.results)
    # Decode graphs without cascade graphs: the decode case only.
    assert [c.name for c in list_graph_cases(SnapshotsSeqLens, quick=True)] == QUICK_NAMES[:1]

    class CascadeOnly(GraphSafeReference):
        cudagraph_support: ClassVar[CudaGraphSupport] = CudaGraphSupport.NEVER

    assert [c.name for c in list_graph_cases(CascadeOnly, quick=True)] == QUICK_NAMES[1:]


@pytest.mark.parametrize("name", list(BROKEN_DECODE))
def test_planted_decode_graph_bugs_fail_only_the_graph_case(name: str) -> None:
    """Each bug passes every eager case (the suite before graph cases let it through) and
    fails the first replay of its decode plan, with the step and the contract in the
    message."""
    report = run_suite(BROKEN_DECODE[name], quick=True, device="cpu")
    assert not report.passed, report.summary()
    (failure,) = report.failures
    assert failure.name == QUICK_NAMES[0], report.summary()
    message = failure.message or ""
    assert message.startswith("replay 1 (4 requests, seq_lens 41, 17, 72, 26)"), message
    assert "prepare_replay" in message and "capture" in message, message


def test_a_capture_that_raises_is_a_failed_case_not_a_crash() -> None:
    report = run_suite(CaptureRaises, quick=True, device="cpu", case_filter="graph/")
    assert [r.status for r in report.results] == ["PASS", "FAIL"], report.summary()
    message = report.failures[0].message or ""
    assert message.startswith("capture step (2 requests + 2 padding, seq_lens 4, 10), "
                              "build_cascade_for_cudagraph_capture: RuntimeError: planted: "
                              "cannot plan this cascade"), message

    class Undeclared(GraphSafeReference):
        """Declares cascade graphs; its builder keeps the base class's capture method."""

        @classmethod
        def get_builder_cls(cls) -> type[MetadataBuilder[Any]]:
            return ReferenceMetadataBuilder

    (result,) = run_suite(Undeclared, quick=True, device="cpu",
                          case_filter="graph/cascade").results
    assert not result.passed and "NotImplementedError" in (result.message or "")
    assert "must override build_cascade_for_cudagraph_capture" in (result.message or "")


def test_graph_cases_follow_exitfirst_and_the_filter() -> None:
    class SnapshotsWithCascade(SnapshotsSeqLens):
        supports_cascade_cudagraph: ClassVar[bool] = True  # the cascade plan is right

    every = run_suite(SnapshotsWithCascade, quick=True, device="cpu", case_filter="graph/")
    assert [r.status for r in every.results] == ["FAIL", "PASS"]
    first = run_suite(SnapshotsWithCascade, quick=True, device="cpu", case_filter="graph/",
                      exitfirst=True)
    assert [r.name for r in first.results] == QUICK_NAMES[:1]
    seen: list[str] = []
    only = run_suite(SnapshotsWithCascade, quick=True, device="cpu",
                     case_filter="graph/cascade", on_result=lambda r: seen.append(r.name))
    assert seen == [r.name for r in only.results] == QUICK_NAMES[1:] and only.passed
    quick = list_graph_cases(GraphSafeReference, quick=True)
    assert len(list_graph_cases(GraphSafeReference, quick=False)) > len(quick) == 2


def test_steps_cover_the_contract() -> None:
    """At every block size: the capture step has padding, the replays grow past block edges
    up to the capacity with another number of real requests; cascade prefixes are block
    multiples within every context, 0 at capture and in a replay, and two others."""
    for bsz in (1, 3, 8, 16, 32, 64):
        cap = graph_capacity(bsz)
        assert cap % bsz == 0 and cap >= 96
        for kind in ("decode", "cascade"):
            steps = graph_steps(kind, bsz)
            seqs = [[c + 1 for c in s.contexts] for s in steps]
            assert all(1 <= len(s) <= BUCKET for s in seqs) and len(seqs[0]) < BUCKET
            assert len({len(s) for s in seqs}) >= 3, seqs
            assert max(map(max, seqs)) == cap and max(seqs[0]) <= max(16, bsz)
            assert all(max(s) <= cap for s in seqs)
            prefixes = [s.prefix_len for s in steps]
            if kind == "decode":
                assert set(prefixes) == {0}
                continue
            assert prefixes[0] == 0 and 0 in prefixes[1:] and len(set(prefixes)) == 3
            for s in steps:
                assert s.prefix_len % bsz == 0 and s.prefix_len <= min(s.contexts)
        # Mixed buckets: decodes first, then prompt chunks, within the token slots; one chunk
        # starts exactly at the prefix; a step leaves padding tokens; the capacity is reached.
        steps = graph_steps("cascade_mixed", bsz)
        assert [s.prefix_len for s in steps] == [s.prefix_len
                                                 for s in graph_steps("cascade", bsz)]
        for s in steps:
            q = list(s.queries)
            assert q == sorted(q) and q[0] == 1 and q[-1] > 1 and sum(q) <= MIXED_TOKENS
            assert s.prefix_len <= min(s.contexts)
            assert max(c + n for c, n in zip(s.contexts, q, strict=True)) <= cap
        assert any(s.prefix_len and s.prefix_len in s.contexts for s in steps)
        assert any(sum(s.queries) < MIXED_TOKENS for s in steps[1:])
        assert max(c + n for s in steps for c, n in zip(s.contexts, s.queries,
                                                        strict=True)) == cap


def test_the_backend_sees_the_engine_s_buffers_poisoned() -> None:
    """Every call gets the same metadata object over the same buffers (max_seq_len = the
    capacity), padding rows as the contract says (query length 1, seq_len 1, null-block row,
    slot -1, NaN query), and a cache that is NaN wherever no written token is."""
    calls: list[dict[str, Any]] = []

    class Spy(LiveGraphImpl):
        def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    kv_cache: torch.Tensor, metadata: Any, *,
                    output: torch.Tensor | None = None) -> torch.Tensor:
            c = metadata.common
            calls.append({"common": c, "table": c.block_table.data_ptr(),
                          "seq": c.seq_lens.clone(), "rows": c.block_table.clone(),
                          "qsl": c.query_start_loc.clone(),
                          "slots": c.slot_mapping.clone(), "query": query.clone(),
                          "written": int((~torch.isnan(kv_cache)).sum())})
            return super().forward(query, key, value, kv_cache, metadata, output=output)

    class SpyBackend(GraphSafeReference):
        @classmethod
        def get_impl_cls(cls) -> type[AttentionImpl[Any]]:
            return Spy

    report = run_suite(SpyBackend, quick=True, device="cpu", case_filter="graph/decode")
    assert report.passed, report.summary()
    steps = graph_steps("decode", 16)
    assert len(calls) == len(steps)
    per_token = 2 * 2 * 32  # K and V, 2 KV heads, head size 32
    for call, step in zip(calls, steps, strict=True):
        n = len(step.contexts)
        assert call["common"] is calls[0]["common"] and call["table"] == calls[0]["table"]
        assert call["common"].max_seq_len == graph_capacity(16)
        assert call["seq"].tolist() == [c + 1 for c in step.contexts] + [1] * (BUCKET - n)
        # A uniform single-token batch, padding rows included (as the engine's decode graphs
        # fill it): a builder may refuse anything else at capture.
        assert call["qsl"].tolist() == list(range(BUCKET + 1))
        assert not call["rows"][n:].any() and (call["slots"][n:] == -1).all()
        assert torch.isnan(call["query"][n:]).all() and not torch.isnan(call["query"][:n]).any()
        assert call["written"] == sum(c + 1 for c in step.contexts) * per_token


def test_cli_lists_and_runs_the_graph_cases() -> None:
    target = "broken_graph_backends:GraphSafeReference"
    listed = CliRunner().invoke(conformance, [target, "--quick", "--device", "cpu", "-k",
                                              "graph/", "--list"])
    assert listed.exit_code == 0 and listed.output.split() == QUICK_NAMES, listed.output
    ran = CliRunner().invoke(conformance, ["broken_graph_backends:PlansOnTheHostAtCapture",
                                           "--quick", "--device", "cpu", "-k", "graph/"])
    assert ran.exit_code == 1 and "graph/decode/float32" in ran.output
    assert "FAIL" in ran.output and "replay 1" in ran.output, ran.output


def test_pytest_plugin_adds_a_test_per_plan_case(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_inprocess(
        "-p", "no:cacheprovider", "--pagedcore-backend",
        "broken_graph_backends:PlansOnTheHostAtCapture", "--pagedcore-quick",
        "--pagedcore-device", "cpu", "--pagedcore-only",
    )
    outcomes = result.parseoutcomes()
    assert outcomes["failed"] == 1 and outcomes["passed"] > 10, outcomes
    result.stdout.fnmatch_lines(["*graph/decode/float32/hs32/bs16/h8kv2: replay 1*"])


@pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
def test_triton_passes_the_graph_cases() -> None:
    triton = _triton()
    report = run_suite(triton, quick=True, device=_device(), case_filter="graph/")
    names = [r.name.split("/")[1] for r in report.results]
    assert names == ["decode", "cascade", "cascade_mixed"], report.summary()
    assert report.passed, report.summary()


@pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
def test_triton_without_cascade_refresh_fails_the_cascade_case() -> None:
    """(b) `prepare_replay` a no-op: the suffix lengths and shifted block table stay those
    of the capture step, so the first replay with a prefix reads the wrong blocks."""
    _triton()
    report = run_suite(triton_without_cascade_refresh(), quick=True, device=_device(),
                       case_filter="graph/")
    assert [r.status for r in report.results] == ["PASS", "FAIL", "FAIL"], report.summary()
    failure, mixed = report.failures
    assert failure.name.startswith("graph/cascade/"), report.summary()
    assert "replay 1 (4 requests, seq_lens 41, 33, 72, 51, prefix_len 32)" in (
        failure.message or ""), failure.message
    assert "prefix_len were rewritten" in (failure.message or "")
    # The mixed bucket's plan keeps the capture step's suffix buffers just the same.
    assert mixed.name.startswith("graph/cascade_mixed/"), report.summary()
    assert ("replay 1 (4 requests, seq_lens 41, 72, 37, 59, query_lens 1, 1, 5, 9, "
            "prefix_len 32)") in (mixed.message or ""), mixed.message
