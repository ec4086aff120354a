"""A shared-prefix step that a CUDA graph would serve cascades only when the reads it saves
outweigh the lost replay (`CascadePlanner.against_graph`); CPU, `EagerCapturer` graphs."""

from __future__ import annotations

from typing import Any

import pytest
from engine_helpers import assert_no_leak, make_models, random_prompts
from mixed_graph_backend import mixed_backend_registered

from pagedcore import LLM, SamplingParams
from pagedcore.attention.cascade import CASCADE_GRAPH_LOSS_BYTES_PER_LAYER, cascade_beats_graph
from pagedcore.engine.runner import cascade_plan
from pagedcore.engine.runner.cuda_graph import EagerCapturer


def test_cascade_beats_graph_counts_the_saved_bytes() -> None:
    # 64 requests x 4,096 shared tokens of 8 KV heads x 128 x bf16 (4 KiB a token per layer).
    assert not cascade_beats_graph(4096, 64, 4096)  # 1.06 GB saved per layer
    assert cascade_beats_graph(16384, 64, 4096)  # 4.2 GB: worth the eager step
    assert cascade_beats_graph(100, 3, 10**7)
    assert not cascade_beats_graph(0, 64, 4096) and not cascade_beats_graph(10**6, 1, 4096)
    assert cascade_beats_graph(10, 2, 1, loss_bytes=10)
    assert CASCADE_GRAPH_LOSS_BYTES_PER_LAYER == 2_000_000_000


def test_against_graph_keeps_a_cascade_only_if_some_group_pays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pagedcore.attention.cascade import CASCADE_ENV
    from pagedcore.kv_cache.spec import FullAttentionSpec, KVCacheGroupSpec
    from pagedcore.reference import ReferenceBackend

    monkeypatch.setenv(CASCADE_ENV, "auto")
    # 8 KV heads x 128 x bf16: 4,096 bytes of K and V per token and layer.
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")
    groups = [KVCacheGroupSpec(layer_names=(f"model.layers.{i}.attn",), spec=spec)
              for i in range(2)]
    planner = cascade_plan.CascadePlanner(groups, [ReferenceBackend] * 2)
    assert planner.token_bytes == [4096, 4096]
    assert planner.against_graph((4096, 4096), 64) == (0, 0)  # 1 GB a layer: replay instead
    assert planner.against_graph((16384, 0), 64) == (16384, 0)  # 4 GB: the step cascades
    planner.set_mode("always")
    assert planner.against_graph((4096, 4096), 64) == (4096, 4096)


def _run(mode: str, monkeypatch: pytest.MonkeyPatch) -> tuple[list[Any], dict[str, int]]:
    # Make `auto` consider every shared prefix (the real rule needs >= 16K saved tokens).
    monkeypatch.setattr(cascade_plan, "cascade_pays", lambda *_a, **_k: True)
    seen = {"cascade_builds": 0, "decode_replays": 0}
    with mixed_backend_registered() as name:
        _c, _r, model = make_models("qwen2")
        llm = LLM(model, device="cpu", backend=name, block_size=4, max_model_len=64,
                  max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory_bytes=1 << 21)
        runner: Any = llm.runner
        capturer = EagerCapturer()
        assert runner.enable_cudagraphs(capturer=capturer, sizes=[1, 2, 4]) is None
        runner.cascade.set_mode(mode)
        builder = runner.builders[0]
        build = builder.build

        def counted(common: Any, common_prefix_len: int = 0, **kw: Any) -> Any:
            seen["cascade_builds"] += common_prefix_len > 0
            return build(common, common_prefix_len=common_prefix_len, **kw)

        builder.build = counted
        base = random_prompts([21], seed=3)[0]
        prompts = [base + tail for tail in random_prompts([3, 5, 2], seed=4)]
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
        llm.generate(prompts[:1], SamplingParams(max_tokens=1))  # the prefix, cached
        mixed = runner.mixed_graphs
        before = capturer.num_replays - mixed.num_replays
        outs = llm.generate(prompts, params)
        seen["decode_replays"] = capturer.num_replays - mixed.num_replays - before
        assert all(o.num_cached_tokens == 20 for o in outs)  # 5 shared blocks of 4
        assert_no_leak(llm)
    return outs, seen


def test_a_graph_step_cascades_only_when_forced_or_worth_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    auto, seen_auto = _run("auto", monkeypatch)
    forced, seen_forced = _run("always", monkeypatch)
    # auto: the tiny model's saved reads are far below a lost replay: every decode step
    # replays its graph, no step cascades. always: the decode steps cascade, eagerly.
    assert seen_auto["cascade_builds"] == 0 and seen_auto["decode_replays"] >= 5
    assert seen_forced["cascade_builds"] >= 5 and seen_forced["decode_replays"] == 0
    for a, f in zip(auto, forced, strict=True):
        assert a.outputs[0].token_ids == f.outputs[0].token_ids
        for la, lf in zip(a.outputs[0].logprobs, f.outputs[0].logprobs, strict=True):
            assert all(abs(v - lf[k]) < 1e-4 for k, v in la.items() if k in lf)
