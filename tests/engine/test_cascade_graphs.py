"""Decode steps that share a prefix replay a captured cascade graph (`CascadeDecodeGraphs`):
the step's prefix length goes into a device scalar before the replay, the outputs equal
transformers' and the plain engine's, nothing leaks; CPU, `EagerCapturer` graphs over a test
backend whose cascade plan reads the shared blocks from block-table row 0."""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import pytest
import torch
from engine_helpers import assert_no_leak, check_outputs_against_hf, make_models, random_prompts
from graph_backend import attend_rows, backend_registered
from mixed_graph_backend import GraphMixedBackend, GraphMixedBuilder, GraphMixedImpl

from pagedcore import LLM, SamplingParams
from pagedcore.attention.backend import AttentionImpl, CudaGraphSupport, MetadataBuilder
from pagedcore.attention.metadata import CommonAttentionMetadata
from pagedcore.engine.runner import cascade_plan
from pagedcore.engine.runner.cuda_graph import EagerCapturer
from pagedcore.plugins.validation import declaration_problems


@attrs.frozen(eq=False)
class CascadeGraphMetadata:
    """A decode bucket over the persistent buffers whose first ``prefix_len[0]`` tokens
    are read from block-table row 0 for every request (values read at run time)."""

    common: CommonAttentionMetadata
    prefix_len: torch.Tensor


class CascadeGraphBuilder(GraphMixedBuilder):
    """Plans cascade graphs; records the prefix length of every replay it prepares."""

    seen: ClassVar[list[int]] = []

    def build_cascade_for_cudagraph_capture(
        self, common: CommonAttentionMetadata, prefix_len: torch.Tensor, capacity: int
    ) -> Any:
        assert capacity == common.block_table.shape[1] * self.kv_cache_spec.block_size
        return CascadeGraphMetadata(common, prefix_len)

    def prepare_replay(self, metadata: Any, common: CommonAttentionMetadata) -> None:
        if isinstance(metadata, CascadeGraphMetadata):
            assert metadata.common.block_table.data_ptr() == common.block_table.data_ptr()
            CascadeGraphBuilder.seen.append(int(metadata.prefix_len[0]))


class CascadeGraphImpl(GraphMixedImpl):
    """The shared blocks from row 0, the rest from each request's own row: exact only when
    the engine's prefix length is really shared (a wrong one reads another request's KV)."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: Any, *,
                output: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(metadata, CascadeGraphMetadata):
            return super().forward(query, key, value, kv_cache, metadata, output=output)
        common = metadata.common
        table = common.block_table.long()
        shared = (torch.arange(table.shape[1]) * kv_cache.shape[2] < metadata.prefix_len)
        table = torch.where(shared[None, :], table[:1], table)
        seq = common.seq_lens.long()
        pos = torch.arange(table.shape[1] * kv_cache.shape[2])
        return attend_rows(self, query, kv_cache, table, seq - 1, pos[None, :] < seq[:, None],
                           output)


class CascadeGraphBackend(GraphMixedBackend):
    name: ClassVar[str] = "graph_cascade_test"
    supports_cascade_cudagraph: ClassVar[bool] = True

    @classmethod
    def get_builder_cls(cls) -> type[MetadataBuilder[Any]]:
        return CascadeGraphBuilder

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl[Any]]:
        return CascadeGraphImpl


def _engine(name: str, mode: str, **kwargs: Any) -> tuple[LLM, Any]:
    _c, ref, model = make_models("qwen2")
    llm = LLM(model, device="cpu", backend=name, block_size=4, max_model_len=64,
              max_num_seqs=4, max_num_batched_tokens=64, **kwargs)
    runner: Any = llm.runner
    assert runner.enable_cudagraphs(capturer=EagerCapturer(), sizes=[1, 2, 4]) is None
    runner.cascade.set_mode(mode)
    return llm, ref


@pytest.fixture
def pays(monkeypatch: pytest.MonkeyPatch) -> None:
    """`auto` considers every shared prefix (the real rule needs >= 16K saved tokens)."""
    monkeypatch.setattr(cascade_plan, "cascade_pays", lambda *_a, **_k: True)
    CascadeGraphBuilder.seen = []


def test_shared_prefix_decodes_replay_the_cascade_graph(pays: None) -> None:
    base = random_prompts([21], seed=3)[0]
    prompts = [base + tail for tail in random_prompts([3, 5, 2], seed=4)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    with backend_registered(CascadeGraphBackend, "graph-cascade-test") as name:
        llm, ref = _engine(name, "auto")
        runner: Any = llm.runner
        llm.generate(prompts[:1], SamplingParams(max_tokens=1))  # the prefix, cached
        eager = runner.builders[0].build
        builds: list[int] = []

        def recording_build(c: Any, common_prefix_len: int = 0, **kw: Any) -> Any:
            builds.append(common_prefix_len)
            return eager(c, common_prefix_len=common_prefix_len, **kw)

        runner.builders[0].build = recording_build
        outs = llm.generate(prompts, params)
        assert all(o.num_cached_tokens == 20 for o in outs)  # 5 shared blocks of 4
        check_outputs_against_hf(ref, prompts, outs, 6)
        graphs = runner.cascade_graphs
        assert graphs.num_replays >= 5 and sorted(graphs.graphs) == [4]
        # Every replay cascaded over the 20 shared tokens; no step cascaded eagerly.
        assert CascadeGraphBuilder.seen and set(CascadeGraphBuilder.seen) == {20}
        assert not any(builds), builds
        paths = llm.stats()["cudagraph"]["step_paths"]
        assert paths["cascade graph"] == graphs.num_replays and "eager (cascade plan)" not in paths
        assert_no_leak(llm)


def test_cascade_graph_with_samples_and_preemption_equals_plain(pays: None) -> None:
    """n = 3 seeded samples of one prompt (they share its blocks) and five requests over a
    shared prompt in a KV budget that preempts: the same tokens and logprobs with cascade
    graphs as with cascade off."""
    base = random_prompts([13], seed=5)[0]
    prompts = [base + tail for tail in random_prompts([2, 6, 4, 7, 3], seed=6)]
    greedy = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, logprobs=1)
    samples = SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=7, ignore_eos=True,
                             logprobs=1)
    results, preemptions, replays = {}, {}, {}
    with backend_registered(CascadeGraphBackend, "graph-cascade-test") as name:
        for mode in ("auto", "off"):
            # 2 layers x K/V x 4 tokens x 2 KV heads x 16 x float32 per block: 18 blocks.
            llm, _ = _engine(name, mode, kv_cache_memory_bytes=18 * 2 * 2 * 4 * 2 * 16 * 4)
            runs = [llm.generate(prompts, greedy), llm.generate(prompts[:1], samples)]
            results[mode] = [[(c.token_ids, c.logprobs) for o in r for c in o.outputs]
                             for r in runs]
            preemptions[mode] = llm.stats()["preemptions"]
            replays[mode] = llm.runner.cascade_graphs.num_replays  # type: ignore[union-attr]
            assert_no_leak(llm)
    assert preemptions["auto"] >= 1 and replays["auto"] >= 4 and replays["off"] == 0
    for on, off in zip(results["auto"], results["off"], strict=True):
        for (tok_a, lp_a), (tok_b, lp_b) in zip(on, off, strict=True):
            assert tok_a == tok_b
            assert lp_a is not None and lp_b is not None
            for a, b in zip(lp_a, lp_b, strict=True):
                assert all(abs(a[t] - b[t]) < 1e-4 for t in a)


def test_cascade_graph_declaration_needs_cascade_and_decode_graphs() -> None:
    class NoGraphs(CascadeGraphBackend):
        name: ClassVar[str] = "no_graphs"
        cudagraph_support: ClassVar[CudaGraphSupport] = CudaGraphSupport.NEVER

    problems = declaration_problems(NoGraphs)
    assert any("supports_cascade_cudagraph" in p and "UNIFORM_SINGLE_TOKEN_DECODE" in p
               for p in problems), problems
    assert declaration_problems(CascadeGraphBackend) == []


class BrokenCascadeBuilder(CascadeGraphBuilder):
    def build_cascade_for_cudagraph_capture(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("planted: cannot plan this cascade")


class BrokenCascadeBackend(CascadeGraphBackend):
    name: ClassVar[str] = "graph_cascade_broken_test"

    @classmethod
    def get_builder_cls(cls) -> type[MetadataBuilder[Any]]:
        return BrokenCascadeBuilder


def test_a_failing_cascade_capture_falls_back_with_a_warning(pays: None) -> None:
    """A backend whose cascade capture raises: the first shared-prefix decode step warns,
    cascade graphs go off, and every request still gets transformers' tokens."""
    base = random_prompts([21], seed=3)[0]
    prompts = [base + tail for tail in random_prompts([3, 5], seed=4)]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=1)
    with backend_registered(BrokenCascadeBackend, "graph-cascade-broken") as name:
        llm, ref = _engine(name, "auto")
        llm.generate(prompts[:1], SamplingParams(max_tokens=1))
        with pytest.warns(RuntimeWarning, match="planted: cannot plan this cascade"):
            outs = llm.generate(prompts, params)
        assert llm.runner.cascade_graphs is None  # type: ignore[union-attr]
        check_outputs_against_hf(ref, prompts, outs, 5)
        assert all(o.outputs[0].finish_reason == "length" for o in outs)
        assert_no_leak(llm)


# ---- mixed steps (`CascadeMixedGraphs`) -------------------------------------------------


@attrs.frozen(eq=False)
class CascadeMixedMetadata:
    """A mixed token bucket over the persistent buffers whose first ``prefix_len[0]`` tokens
    are read from block-table row 0 for every request (values read at run time)."""

    common: CommonAttentionMetadata
    prefix_len: torch.Tensor


class CascadeMixedBuilder(CascadeGraphBuilder):
    """Plans mixed cascade graphs too; records each mixed replay's prefix length and the
    host arrays `prepare_replay` got (the contract: the loaded step's, padding after)."""

    seen_mixed: ClassVar[list[tuple[int, list[int], list[int]]]] = []

    def build_cascade_for_cudagraph_capture(
        self, common: CommonAttentionMetadata, prefix_len: torch.Tensor, capacity: int
    ) -> Any:
        if common.max_query_len == 1:
            return super().build_cascade_for_cudagraph_capture(common, prefix_len, capacity)
        assert common.max_query_len == common.num_actual_tokens
        assert capacity == common.block_table.shape[1] * self.kv_cache_spec.block_size
        return CascadeMixedMetadata(common, prefix_len)

    def prepare_replay(self, metadata: Any, common: CommonAttentionMetadata) -> None:
        if not isinstance(metadata, CascadeMixedMetadata):
            return super().prepare_replay(metadata, common)
        assert metadata.common.block_table.data_ptr() == common.block_table.data_ptr()
        # The host arrays hold the device buffers' values (the step, then padding).
        assert common.query_start_loc_cpu.tolist() == common.query_start_loc.tolist()
        assert common.seq_lens_cpu.tolist() == common.seq_lens.tolist()
        CascadeMixedBuilder.seen_mixed.append((int(metadata.prefix_len[0]),
                                               common.query_start_loc_cpu.tolist(),
                                               common.seq_lens_cpu.tolist()))


class CascadeMixedImpl(CascadeGraphImpl):
    """`GraphMixedImpl`'s mixed forward with the shared blocks read from row 0."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: Any, *,
                output: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(metadata, CascadeMixedMetadata):
            return super().forward(query, key, value, kv_cache, metadata, output=output)
        common = metadata.common
        qsl, seq = common.query_start_loc.long(), common.seq_lens.long()
        tok = torch.arange(query.shape[0])
        real = tok < qsl[-1]
        req = torch.searchsorted(qsl[1:], tok, right=True).clamp(max=seq.shape[0] - 1)
        pos_q = seq[req] - (qsl[req + 1] - qsl[req]) + (tok - qsl[req])
        rows = common.block_table.long()
        shared = torch.arange(rows.shape[1]) * kv_cache.shape[2] < metadata.prefix_len
        table = torch.where(shared[None, :], rows[:1], rows)[req]
        pos = torch.arange(table.shape[1] * kv_cache.shape[2])
        visible = (pos[None, :] <= pos_q[:, None]) & real[:, None]
        return attend_rows(self, query, kv_cache, table, pos_q, visible, output)


class CascadeMixedBackend(CascadeGraphBackend):
    name: ClassVar[str] = "graph_cascade_mixed_test"
    supports_cascade_mixed_cudagraph: ClassVar[bool] = True

    @classmethod
    def get_builder_cls(cls) -> type[MetadataBuilder[Any]]:
        return CascadeMixedBuilder

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl[Any]]:
        return CascadeMixedImpl


def _record_eager_builds(builder: Any) -> list[int]:
    """Wrap `builder.build`: the returned list gets each eager plan's prefix length."""
    eager = builder.build
    builds: list[int] = []

    def build(c: CommonAttentionMetadata, common_prefix_len: int = 0, **kw: Any) -> Any:
        builds.append(common_prefix_len)
        return eager(c, common_prefix_len=common_prefix_len, **kw)

    builder.build = build
    return builds


def _mixed_engine(name: str, mode: str) -> tuple[LLM, Any]:
    llm, ref = _engine(name, mode)
    CascadeMixedBuilder.seen_mixed = []
    return llm, ref


def test_shared_prefix_mixed_steps_replay_the_mixed_cascade_graph(pays: None) -> None:
    """Prompts over a cached 20-token prefix prefill in one mixed step, and a second group
    arrives while the first decodes: those steps replay the mixed cascade graph with P = 20
    (no eager cascade, no plain mixed replay), the decodes the decode cascade graph, and
    the tokens and logprobs are transformers' and those of cascade off."""
    base = random_prompts([21], seed=3)[0]
    prompts = [base + tail for tail in random_prompts([3, 5, 2, 6], seed=4)]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2)
    results = {}
    with backend_registered(CascadeMixedBackend, "graph-cascade-mixed-test") as name:
        for mode in ("auto", "off"):
            llm, ref = _mixed_engine(name, mode)
            runner: Any = llm.runner
            llm.generate(prompts[:1], SamplingParams(max_tokens=1))  # the prefix, cached
            builds = _record_eager_builds(runner.builders[0])
            for i, p in enumerate(prompts[:2]):
                llm.add_request(f"a{i}", p, params)
            outs = list(llm.step())  # the first two prefill together (a mixed step)
            for i, p in enumerate(prompts[2:]):
                llm.add_request(f"b{i}", p, params)  # they join the decoding pair
            while llm.has_unfinished_requests():
                outs += llm.step()
            done = sorted((o for o in outs if o.finished), key=lambda o: o.request_id)
            assert [o.request_id for o in done] == ["a0", "a1", "b0", "b1"]
            assert all(o.num_cached_tokens == 20 for o in done)  # 5 shared blocks of 4
            ordered = [done[i] for i in (0, 1, 2, 3)]
            check_outputs_against_hf(ref, prompts, ordered, 5)
            results[mode] = [(c.token_ids, c.logprobs) for o in ordered for c in o.outputs]
            paths = llm.stats()["cudagraph"]["step_paths"]
            mixed = runner.cascade_mixed_graphs
            if mode == "auto":
                assert not any(builds), builds  # nothing cascaded eagerly
                assert paths["cascade mixed graph"] == mixed.num_replays >= 2, paths
                assert "eager (cascade plan)" not in paths, paths
                assert {p for p, _, _ in CascadeMixedBuilder.seen_mixed} == {20}
                # The step where b0 and b1 join a0 and a1: 2 decodes, then their prompts.
                joined = [(qsl, seq) for p, qsl, seq in CascadeMixedBuilder.seen_mixed
                          if qsl[:3] == [0, 1, 2]]
                assert joined and joined[0][1][:4] == [25, 27, 23, 27], joined
            else:
                assert mixed.num_replays == 0 and "cascade mixed graph" not in paths
            assert_no_leak(llm)
    assert results["auto"] == results["off"]


class BrokenMixedCascadeBuilder(CascadeMixedBuilder):
    def build_cascade_for_cudagraph_capture(
        self, common: CommonAttentionMetadata, prefix_len: torch.Tensor, capacity: int
    ) -> Any:
        if common.max_query_len > 1:
            raise RuntimeError("planted: cannot plan this mixed cascade")
        return super().build_cascade_for_cudagraph_capture(common, prefix_len, capacity)


class BrokenMixedCascadeBackend(CascadeMixedBackend):
    name: ClassVar[str] = "graph_cascade_mixed_broken_test"

    @classmethod
    def get_builder_cls(cls) -> type[MetadataBuilder[Any]]:
        return BrokenMixedCascadeBuilder


def test_a_failing_mixed_cascade_capture_falls_back_with_a_warning(pays: None) -> None:
    """The mixed capture raises: the step warns and cascades eagerly, mixed cascade graphs
    go off (decode cascade graphs stay), and the tokens are transformers'."""
    base = random_prompts([21], seed=3)[0]
    prompts = [base + tail for tail in random_prompts([3, 5], seed=4)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=1)
    with backend_registered(BrokenMixedCascadeBackend, "graph-cascade-mixed-broken") as name:
        llm, ref = _mixed_engine(name, "auto")
        llm.generate(prompts[:1], SamplingParams(max_tokens=1))
        with pytest.warns(RuntimeWarning, match="planted: cannot plan this mixed cascade"):
            outs = llm.generate(prompts, params)
        runner: Any = llm.runner
        assert runner.cascade_mixed_graphs is None and runner.cascade_graphs is not None
        paths = llm.stats()["cudagraph"]["step_paths"]
        assert paths["eager (cascade plan)"] >= 1 and paths["cascade graph"] >= 1, paths
        check_outputs_against_hf(ref, prompts, outs, 4)
        assert_no_leak(llm)


def test_mixed_cascade_graph_declaration_needs_cascade_graphs_and_mixed_graphs() -> None:
    class DecodeGraphsOnly(CascadeMixedBackend):
        name: ClassVar[str] = "decode_graphs_only"
        cudagraph_support: ClassVar[CudaGraphSupport] = (
            CudaGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE)

    problems = declaration_problems(DecodeGraphsOnly)
    assert any("supports_cascade_mixed_cudagraph" in p and "ALWAYS" in p
               for p in problems), problems
    assert declaration_problems(CascadeMixedBackend) == []
