"""Prompt logprobs on every step path: mixed-step CUDA graphs (replayed eagerly on the CPU) with
overlap scheduling on, against transformers' full-sequence forward."""

from __future__ import annotations

import copy
from typing import Any

import torch
from engine_helpers import assert_no_leak, make_models, random_prompts
from mixed_graph_backend import mixed_backend_registered

from pagedcore import LLM, SamplingParams
from pagedcore.engine.runner.cuda_graph import EagerCapturer


def test_mixed_graphs_and_overlap_give_transformers_prompt_logprobs() -> None:
    _config, ref, model = make_models("llama")
    prompts = random_prompts([37, 5, 21], seed=4)
    plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with mixed_backend_registered() as name:
        llm = LLM(copy.deepcopy(model), device="cpu", backend=name, block_size=4,
                  max_model_len=96, max_num_seqs=8, max_num_batched_tokens=32,
                  kv_cache_memory_bytes=1 << 21, async_scheduling=True)
        assert llm.runner.enable_cudagraphs(capturer=EagerCapturer(), sizes=[1, 2, 4, 8]) is None
        mixed = llm.runner.mixed_graphs
        assert mixed is not None
        # Requests without prompt logprobs run beside (and before) the one with them.
        llm.add_request("a", prompts[1], plain)
        llm.step()
        llm.add_request("b", prompts[0], plain.replace(prompt_logprobs=2))
        llm.add_request("c", prompts[2], plain)
        before = mixed.num_replays
        done: dict[str, Any] = {}
        while llm.has_unfinished_requests():
            done.update({o.request_id: o for o in llm.step() if o.finished})
        done.update({o.request_id: o for o in llm.drain() if o.finished})
        assert mixed.num_replays > before  # steps with prompt rows replayed mixed graphs
        assert llm.async_scheduling  # still on: only the steps computing them ran in sync
    got = done["b"].prompt_logprobs
    assert got is not None and len(got) == len(prompts[0]) and got[0] is None
    assert done["a"].prompt_logprobs is None
    with torch.no_grad():
        want = ref(torch.tensor([prompts[0]])).logits[0].log_softmax(-1)
    worst = 0.0
    for j in range(1, len(prompts[0])):
        entry, row, token = got[j], want[j - 1], prompts[0][j]
        assert entry is not None and token in entry
        assert entry[token].rank == 1 + int((row > row[token]).sum())
        assert set(row.topk(2).indices.tolist()) <= set(entry)
        worst = max(worst, *(abs(lp.logprob - float(row[t])) for t, lp in entry.items()))
    assert worst < 1e-4, worst
    # The generated tokens are transformers' greedy ones too.
    out = ref.generate(torch.tensor([prompts[0]]), max_new_tokens=6, do_sample=False,
                       eos_token_id=None, pad_token_id=0)
    assert done["b"].outputs[0].token_ids == out[0, len(prompts[0]):].tolist()
    assert_no_leak(llm)


def test_one_token_prompt_chunks_skip_decode_graphs_on_every_rank() -> None:
    """A step of one-token chunks fits a decode graph, unless one chunk's logits give a prompt
    logprob: rank 0 then runs it eagerly, and its plan tells the TP workers to do the same."""
    from graph_backend import graph_backend_registered

    from pagedcore.engine.distributed.plan import make_plan, scheduled_from_plan
    from pagedcore.engine.runner.prompt_rows import prompt_rows_wanted
    from pagedcore.engine.scheduling.request import Request
    from pagedcore.engine.scheduling.scheduler_types import ScheduledRequest

    _config, _ref, model = make_models("llama")
    with graph_backend_registered() as name:
        llm = LLM(copy.deepcopy(model), device="cpu", backend=name, block_size=4,
                  max_model_len=32, max_num_seqs=4, kv_cache_memory_bytes=1 << 20)
        assert llm.runner.enable_cudagraphs(capturer=EagerCapturer(), sizes=[1, 2]) is None
        runner = llm.runner
        prompt = list(range(3, 11))
        wants = Request("w", prompt, SamplingParams(prompt_logprobs=1), arrival_index=0)
        plain = Request("p", prompt, SamplingParams(), arrival_index=1)
        blocks = {"w": ([1, 2],), "p": ([3, 4],)}
        for request in (wants, plain):
            request.num_computed_tokens = 4
        step = [ScheduledRequest(wants, 4, 1), ScheduledRequest(plain, 4, 1)]
        assert prompt_rows_wanted(step)
        inputs = runner.prepare(step, blocks.__getitem__)
        assert inputs.cudagraph_bucket is None and inputs.prompt_rows is not None
        plan = make_plan(0, step, blocks.__getitem__,
                         decode_graph=not prompt_rows_wanted(step))
        worker_step, worker_blocks = scheduled_from_plan(plan)
        assert not plan.decode_graph
        assert runner.prepare(worker_step, worker_blocks,
                              decode_graph=plan.decode_graph).cudagraph_bucket is None
        # Without the flag a worker would replay the bucket-2 graph: the ranks would diverge.
        assert runner.prepare(worker_step, worker_blocks).cudagraph_bucket == 2
        # The same step without prompt logprobs replays the graph on rank 0 too.
        other = Request("o", prompt, SamplingParams(), arrival_index=2)
        other.num_computed_tokens = 4
        blocks["o"] = ([5, 6],)
        assert runner.prepare([ScheduledRequest(other, 4, 1), step[1]],
                              blocks.__getitem__).cudagraph_bucket == 2
