"""CUDA-graph decode steps: buckets, padding, in-place buffer rewrites, and padded replay equal
to the eager step (CPU: `EagerCapturer` replays the recorded forward on the persistent buffers;
on CUDA the same checks run with real graphs)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from engine_helpers import assert_no_leak, make_models, random_prompts
from graph_backend import (
    GraphDecodeBuilder,
    SnapshotGraphBackend,
    SnapshotGraphBuilder,
    backend_registered,
    graph_backend_registered,
)

from pagedcore import LLM, SamplingParams
from pagedcore.engine.runner.cuda_graph import (
    EagerCapturer,
    capture_sizes,
    cudagraph_unsupported_reason,
    pick_bucket,
)
from pagedcore.engine.runner.input_batch import InputBatch
from pagedcore.engine.scheduling.request import Request
from pagedcore.engine.scheduling.scheduler_types import ScheduledRequest
from pagedcore.reference.backend import ReferenceBackend

CUDA = torch.cuda.is_available()


def test_capture_sizes_and_buckets() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(256)[:6] == [1, 2, 4, 8, 16, 24]
    assert capture_sizes(256)[-1] == 256 and len(capture_sizes(256)) == 35
    assert capture_sizes(36) == [1, 2, 4, 8, 16, 24, 32, 36]
    sizes = capture_sizes(36)
    assert [pick_bucket(n, sizes) for n in (1, 3, 5, 8, 9, 33, 36, 37)] == [
        1, 4, 8, 8, 16, 36, 36, None,
    ]
    with pytest.raises(ValueError, match="positive"):
        capture_sizes(0)


def test_unsupported_reasons() -> None:
    from graph_backend import GraphDecodeBackend

    assert "cpu" in str(cudagraph_unsupported_reason([GraphDecodeBackend], torch.device("cpu")))
    why = cudagraph_unsupported_reason([GraphDecodeBackend, ReferenceBackend],
                                       torch.device("cuda"))
    assert why is not None and "reference (NEVER)" in why and "graph_decode" not in why
    assert cudagraph_unsupported_reason([GraphDecodeBackend], torch.device("cuda")) is None


def _decode(request_id: str, tokens: list[int]) -> ScheduledRequest:
    """A request whose last token is this step's single query token."""
    req = Request(request_id, tokens, SamplingParams(max_tokens=4), arrival_index=0)
    return ScheduledRequest(req, len(tokens) - 1, 1)


def test_padded_decode_rewrites_persistent_buffers_in_place() -> None:
    batch = InputBatch(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=40,
                       block_sizes=[4, 8], device=torch.device("cpu"))
    blocks = {"a": ([3, 4, 5], [7, 2]), "b": ([6], [9]), "c": ([8, 1], [11])}
    step = [_decode("a", list(range(10, 20))), _decode("b", [5, 6, 7]),
            _decode("c", [1, 2, 3, 4, 5, 6])]
    common = batch.graph_common(8)
    ids, pos = batch.graph_inputs(8)
    # Poison the per-token buffers: a value the step forgets to rewrite shows up below (block
    # tables are rewritten per changed row; the smaller second step checks their padding).
    for t in (ids, pos, common[0].seq_lens, common[0].slot_mapping, common[1].slot_mapping,
              common[0].query_start_loc):
        t.fill_(77)
    inputs = batch.prepare(step, blocks.__getitem__, pad_to=8)
    assert inputs.cudagraph_bucket == 8
    assert ids.tolist() == [19, 7, 6, 0, 0, 0, 0, 0]
    assert pos.tolist() == [9, 2, 5, 0, 0, 0, 0, 0]
    assert common[0].query_start_loc.tolist() == list(range(9))
    assert common[0].seq_lens.tolist() == [10, 3, 6, 1, 1, 1, 1, 1]
    # pos 9, block 4: block_table[a][2] = 5 -> 5 * 4 + 1; pos 2 -> 6*4+2; pos 5 -> 1*4+1.
    assert common[0].slot_mapping.tolist() == [21, 26, 5, -1, -1, -1, -1, -1]
    assert common[1].slot_mapping.tolist() == [2 * 8 + 1, 9 * 8 + 2, 11 * 8 + 5] + [-1] * 5
    table0 = common[0].block_table
    assert table0.shape == (8, 10)
    assert table0[0, :4].tolist() == [3, 4, 5, 0] and table0[2, :3].tolist() == [8, 1, 0]
    assert not table0[3:].any() and not table0[:, 3:].any()
    assert common[1].block_table.shape == (8, 5) and not common[1].block_table[3:].any()
    # The step's own views are the persistent buffers.
    assert inputs.input_ids.data_ptr() == ids.data_ptr()
    assert inputs.common[1].block_table.data_ptr() == common[1].block_table.data_ptr()
    assert inputs.logits_indices.tolist() == [0, 1, 2]
    # A smaller next step leaves no stale row behind.
    inputs = batch.prepare(step[1:2], blocks.__getitem__, pad_to=8)
    assert ids.tolist() == [7] + [0] * 7
    assert common[0].seq_lens.tolist() == [3] + [1] * 7
    assert common[0].slot_mapping.tolist() == [26] + [-1] * 7
    assert table0[0, :2].tolist() == [6, 0] and not table0[1:].any()


def test_padded_decode_rejects_prefill_and_oversize() -> None:
    batch = InputBatch(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=40,
                       block_sizes=[4], device=torch.device("cpu"))
    req = Request("p", [1, 2, 3], SamplingParams(max_tokens=4), arrival_index=0)
    with pytest.raises(ValueError, match="query length to be 1"):
        batch.prepare([ScheduledRequest(req, 0, 3)], lambda _: ([1],), pad_to=4)
    step = [_decode(f"r{i}", [1, 2]) for i in range(3)]
    with pytest.raises(ValueError, match="cannot pad"):
        batch.prepare(step, lambda _: ([1],), pad_to=2)


def _engines(arch: str, backend: str, device: str, dtype: torch.dtype,
             **kw: Any) -> tuple[LLM, LLM, EagerCapturer | None]:
    """(eager engine, graph engine, the fake capturer on CPU) on the same weights."""
    _config, _ref, eng = make_models(arch)
    _config, _ref, eng2 = make_models(arch)
    common: dict[str, Any] = dict(device=device, dtype=dtype, backend=backend, block_size=4,
                                  max_model_len=96, max_num_seqs=12,
                                  max_num_batched_tokens=64, kv_cache_memory_bytes=1 << 21, **kw)
    eager = LLM(eng.to(dtype), enforce_eager=True, **common)
    capturer = None if device == "cuda" else EagerCapturer()
    graphs = LLM(eng2.to(dtype), **common)
    if capturer is not None:
        assert "device is cpu" in graphs.stats()["cudagraph"]["reason"]
        graphs.runner.enable_cudagraphs(capturer=capturer, sizes=[1, 2, 4, 8])
    assert eager.stats()["cudagraph"] == {"enabled": False, "reason": "enforce_eager=True",
                                          "sizes": [], "capture_seconds": 0.0,
                                          "step_paths": {}}
    return eager, graphs, capturer


def _compare(arch: str, device: str, dtype: torch.dtype, tol: float) -> None:
    with graph_backend_registered() as name:
        before = GraphDecodeBuilder.num_capture_builds
        eager, graphs, capturer = _engines(arch, name, device, dtype)
        status = graphs.stats()["cudagraph"]
        assert status["enabled"] and status["sizes"] == ([1, 2, 4, 8] if capturer else
                                                         [1, 2, 4, 8, 12])
        groups = len(graphs.kv_cache_config.groups)
        assert GraphDecodeBuilder.num_capture_builds - before == groups * len(status["sizes"])
        # 7 requests, output lengths 3..17: decode batches of 7, 6, ..., 1 (buckets 8, 8, 4,
        # 4, 4, 2, 1) plus mixed steps (prefills run eagerly), and 9 requests (> bucket 8 on
        # the CPU: eager) in the second call.
        prompts = random_prompts([5, 9, 13, 3, 21, 30, 7])
        params = [SamplingParams(max_tokens=3 + 2 * i, temperature=0.0, ignore_eos=True,
                                 logprobs=3) for i in range(len(prompts))]
        expected = eager.generate(prompts, params)
        got = graphs.generate(prompts, params)
        more = random_prompts([4] * 9, seed=3)
        p9 = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
        expected += eager.generate(more, p9)
        got += graphs.generate(more, p9)
        worst = 0.0
        for a, b in zip(expected, got, strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert a.outputs[0].logprobs is not None and b.outputs[0].logprobs is not None
            for ea, eb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
                for token, value in ea.items():
                    if token in eb:
                        worst = max(worst, abs(value - eb[token]) / max(1.0, abs(value)))
        assert worst < tol, f"logprobs differ by up to {worst:.2e} (relative)"
        if capturer is not None:
            assert capturer.num_captures == 4 and capturer.num_replays >= 14
        assert_no_leak(graphs)
        assert_no_leak(eager)


@pytest.mark.parametrize("arch", ["qwen2", "gemma2"])
def test_padded_graph_replay_matches_eager_step_cpu(arch: str) -> None:
    _compare(arch, "cpu", torch.float32, 1e-5)


def test_graphs_disabled_on_cpu_without_capturer() -> None:
    _config, _ref, eng = make_models("llama")
    llm = LLM(eng, device="cpu", max_model_len=64)
    status = llm.stats()["cudagraph"]
    assert not status["enabled"] and "cpu" in status["reason"]
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ["qwen2", "gemma2"])
def test_cuda_graph_replay_matches_eager_gpu(arch: str) -> None:
    _compare(arch, "cuda", torch.float32, 1e-3)


def test_slot_rows_match_eager_layout() -> None:
    """The padded path computes the same slots as the eager path for the real rows."""
    batch = InputBatch(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64,
                       block_sizes=[4], device=torch.device("cpu"))
    rng = np.random.default_rng(0)
    step, blocks = [], {}
    for i in range(6):
        n = int(rng.integers(1, 60))
        step.append(_decode(f"r{i}", list(range(n))))
        blocks[f"r{i}"] = (rng.permutation(np.arange(1, 40))[: -(-n // 4)].tolist(),)
    eager = batch.prepare(step, blocks.__getitem__)
    eager_slots = eager.common[0].slot_mapping.tolist()
    eager_ids = eager.input_ids.tolist()
    padded = batch.prepare(step, blocks.__getitem__, pad_to=8)
    assert padded.common[0].slot_mapping[:6].tolist() == eager_slots
    assert padded.input_ids[:6].tolist() == eager_ids


_TRITON_SCRIPT = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
torch.set_num_threads(1)
sys.path.insert(0, sys.argv[1])
from engine_helpers import make_models, random_prompts
from pagedcore import LLM, SamplingParams
from pagedcore.engine.runner.cuda_graph import EagerCapturer
kw = dict(device="cpu", dtype=torch.float32, backend="triton", block_size=16, max_model_len=96,
          max_num_seqs=8, max_num_batched_tokens=64, kv_cache_memory_bytes=1 << 22)
_, _, a = make_models("gemma2", head_dim=64)
_, _, b = make_models("gemma2", head_dim=64)
eager = LLM(a, enforce_eager=True, **kw)
graphs = LLM(b, **kw)
capturer = EagerCapturer()
graphs.runner.enable_cudagraphs(capturer=capturer, sizes=[2, 4, 8])
prompts = random_prompts([5, 19, 13, 3, 21])
params = [SamplingParams(max_tokens=3 + 3 * i, temperature=0.0, ignore_eos=True, logprobs=3)
          for i in range(5)]
worst = 0.0
for x, y in zip(eager.generate(prompts, params), graphs.generate(prompts, params)):
    assert x.outputs[0].token_ids == y.outputs[0].token_ids
    for la, lb in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
        worst = max([worst] + [abs(v - lb[k]) for k, v in la.items() if k in lb])
assert worst < 1e-4, worst
assert capturer.num_replays >= 10, capturer.num_replays
print("OK", worst, capturer.num_replays)
"""


def test_triton_plan_replays_like_eager_in_interpreter() -> None:
    """The triton backend's capture plan, replayed on rewritten buffers (Triton's CPU
    interpreter, gemma2: a sliding-window and a full group, soft-caps) equals eager steps."""
    import os
    import subprocess
    import sys

    pytest.importorskip("pagedcore_triton")
    from pagedcore_triton.backend import TritonAttentionBackend

    from pagedcore.attention.backend import CudaGraphSupport

    if TritonAttentionBackend.cudagraph_support < CudaGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE:
        pytest.skip("the triton backend does not declare CUDA-graph support")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT, here], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ["qwen2", "gemma2"])
def test_default_backend_graphs_match_eager_bf16(arch: str) -> None:
    """bf16 on CUDA with the backend the selector picks: graph replays agree with eager
    steps (log-probabilities compared while the token histories agree)."""
    from pagedcore.bench.engine_runs import graph_parity

    _config, _ref, a = make_models(arch, head_dim=64)
    _config, _ref, b = make_models(arch, head_dim=64)
    kw: dict[str, Any] = dict(device="cuda", dtype=torch.bfloat16, block_size=16,
                              max_model_len=256, max_num_seqs=16, kv_cache_memory_bytes=1 << 24)
    graphs = LLM(b, **kw)
    status = graphs.stats()["cudagraph"]
    if not status["enabled"]:
        pytest.skip(f"CUDA graphs off with backend {graphs.backend_names}: {status['reason']}")
    eager = LLM(a, enforce_eager=True, **kw)
    report = graph_parity(graphs, eager, random_prompts([5, 40, 17, 3, 90, 33, 8]), max_new=12)
    # bf16: a split-KV plan for max_model_len (graphs) and one for the step (eager) round
    # differently, so a near-tie may flip a token late; a broken replay diverges at once.
    assert report["max_abs_logprob_diff_while_agreeing"] < 0.1, report
    assert report["identical_requests"] >= 4, report
    assert all(step >= 1 for step in report["first_divergence_steps"]), report
    assert_no_leak(graphs)


def test_capture_keeps_the_forward_and_its_plans_alive() -> None:
    """A CUDA graph keeps no reference to what its kernels touch; the engine must keep each
    bucket's forward (and through it the capture plans, with any scratch a backend allocated
    in the warm-up run) alive, or replays overwrite freed memory."""
    import gc

    from pagedcore.engine.runner.cuda_graph import CapturedGraph

    class Forgetful:
        """Like a CUDA graph: runs the forward during capture, keeps no reference to it."""

        def capture(self, fn: Any) -> CapturedGraph:
            return CapturedGraph(lambda: None, fn())

    with graph_backend_registered() as name:
        _config, _ref, eng = make_models("gemma2")
        llm = LLM(eng, device="cpu", backend=name, max_num_seqs=4, max_model_len=64)
        GraphDecodeBuilder.plans.clear()
        llm.runner.enable_cudagraphs(capturer=Forgetful(), sizes=[1, 2, 4])
        gc.collect()
        plans = GraphDecodeBuilder.plans
        assert len(plans) == 6  # 3 buckets x 2 KV-cache groups
        assert all(ref() is not None for ref in plans)


def test_prepare_replay_refreshes_a_plan_that_keeps_its_own_arrays() -> None:
    """A capture plan with its own copy of the lengths replays like eager steps only because
    the runner calls `prepare_replay` before each replay (without it: stale lengths)."""
    with backend_registered(SnapshotGraphBackend, "graph-snapshot-test") as name:
        eager, graphs, capturer = _engines("qwen2", name, "cpu", torch.float32)
        before = SnapshotGraphBuilder.num_refreshes
        prompts = random_prompts([5, 9, 13, 3, 21])
        params = [SamplingParams(max_tokens=4 + 3 * i, temperature=0.0, ignore_eos=True)
                  for i in range(len(prompts))]
        expected = eager.generate(prompts, params)
        got = graphs.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
        assert capturer is not None and capturer.num_replays >= 8
        assert SnapshotGraphBuilder.num_refreshes - before == capturer.num_replays * len(
            graphs.kv_cache_config.groups)
