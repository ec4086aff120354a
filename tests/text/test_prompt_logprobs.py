"""`SamplingParams(prompt_logprobs=k)` against transformers' log-softmax of the full-sequence
forward: values and ranks, with chunked prefill, prefix caching, n > 1, preemption, streaming,
and the validation of bad values."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import torch
from device_helpers import TEST_BACKEND, TEST_DEVICE
from tokenizer_helpers import CORPUS

from pagedcore.engine.llm import LLM
from pagedcore.engine.outputs import RequestOutput
from pagedcore.engine.runner.prompt_rows import plan_prompt_rows
from pagedcore.engine.sampling.sampling_params import SamplingParams
from pagedcore.engine.scheduling.request import Request
from pagedcore.engine.scheduling.scheduler_types import ScheduledRequest
from pagedcore.engine.validation import InvalidArgumentError


def _reference(hf_model: Any, prompt: list[int]) -> torch.Tensor:
    """``[P, V]`` log-softmax of transformers' logits at every prompt position (float32)."""
    with torch.no_grad():
        ids = torch.tensor([prompt], device=TEST_DEVICE)
        return hf_model(ids).logits[0].float().log_softmax(-1).cpu()


def _check(out: RequestOutput, prompt: list[int], ref: torch.Tensor, k: int,
           tokenizer: Any) -> float:
    """Every entry against `ref`; returns the largest absolute error."""
    got = out.prompt_logprobs
    assert got is not None and len(got) == len(prompt) and got[0] is None
    worst = 0.0
    for j in range(1, len(prompt)):
        entry = got[j]
        assert entry is not None
        row = ref[j - 1]
        token = prompt[j]
        top = row.topk(k).indices.tolist() if k else []
        # The prompt token is always there; the top k follow in order, ranks 1..k.
        assert token in entry and set(top) <= set(entry) and len(entry) <= k + 1
        assert entry[token].rank == 1 + int((row > row[token]).sum())
        for rank, t in enumerate(top, start=1):
            assert entry[t].rank == rank or t == token
        for t, lp in entry.items():
            worst = max(worst, abs(lp.logprob - float(row[t])))
            assert lp.decoded_token == tokenizer.decode([t])
    return worst


def _prompts(llm: LLM) -> list[list[int]]:
    """Prompts of about 40, 15 and 60 tokens."""
    return [llm.tokenizer.encode(" ".join(CORPUS[i : i + k])) for i, k in ((0, 3), (1, 1),
                                                                            (2, 4))]


@pytest.fixture(scope="module")
def chunked(multi_eos_checkpoint: Path) -> LLM:
    """Chunked prefill in 16-token chunks (every prompt spans several steps), prefix caching
    on, two sequences per step at most (a third waits, a long one is preempted)."""
    return LLM(str(multi_eos_checkpoint), device=TEST_DEVICE, dtype="float32",
               backend=TEST_BACKEND, max_model_len=128,
               max_num_batched_tokens=16, max_num_seqs=2, enable_prefix_caching=True,
               kv_cache_memory_bytes=8 * 2**20)


def test_values_and_ranks_match_transformers(llm: LLM, chunked: LLM, hf_model: Any) -> None:
    prompts = _prompts(llm)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    for engine in (llm, chunked):
        outs = engine.generate(prompts, params)
        for prompt, out in zip(prompts, outs, strict=True):
            worst = _check(out, prompt, _reference(hf_model, prompt), 3, llm.tokenizer)
            assert worst < 1e-4, worst
    # prompt_logprobs=0: the prompt token alone.
    [zero] = chunked.generate([prompts[0]], params.replace(prompt_logprobs=0))
    assert zero.prompt_logprobs is not None
    assert all(len(e) == 1 for e in zero.prompt_logprobs[1:] if e is not None)
    # Not asked: None.
    [plain] = chunked.generate([prompts[0]], params.replace(prompt_logprobs=None))
    assert plain.prompt_logprobs is None


def test_prefix_cache_hits_are_not_taken(chunked: LLM, hf_model: Any) -> None:
    prompt = _prompts(chunked)[2]
    params = SamplingParams(temperature=0, max_tokens=1)
    chunked.generate([prompt], params)  # the prompt's blocks are now cached
    [warm] = chunked.generate([prompt], params)
    assert warm.num_cached_tokens > 0
    [out] = chunked.generate([prompt], params.replace(prompt_logprobs=2))
    assert out.num_cached_tokens == 0
    assert _check(out, prompt, _reference(hf_model, prompt), 2, chunked.tokenizer) < 1e-4


def test_n_samples_preemption_and_streaming(multi_eos_checkpoint: Path, hf_model: Any) -> None:
    # 12 blocks of 16 tokens for two prompts of ~60 tokens, 2 samples each, each sample
    # growing by 40: samples are preempted (prompt-logprob ones among them) and recompute
    # their prefill, which must add no entry twice.
    tight = LLM(str(multi_eos_checkpoint), device=TEST_DEVICE, dtype="float32",
                backend=TEST_BACKEND, max_model_len=128, max_num_batched_tokens=32,
                enable_prefix_caching=False, block_size=16,
                kv_cache_memory_bytes=12 * _block_bytes(multi_eos_checkpoint))
    prompt = _prompts(tight)[2]
    ref = _reference(hf_model, prompt)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=1,
                            n=2)
    outs = tight.generate([prompt, prompt], params)
    # (`metrics` are sample 0's: the one computing the prompt logprobs.)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    for out in outs:
        assert len(out.outputs) == 2
        assert _check(out, prompt, ref, 1, tight.tokenizer) < 1e-4
    # Streaming: the deltas carry the prompt logprobs once, equal to the final ones.
    deltas = list(tight.stream([prompt], SamplingParams(temperature=0, max_tokens=3,
                                                        prompt_logprobs=1)))
    carried = [d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None]
    assert len(carried) == 1
    assert _check(attrs.evolve(deltas[-1], prompt_logprobs=carried[0]), prompt, ref, 1,
                  tight.tokenizer) < 1e-4


def _block_bytes(path: Path) -> int:
    """Bytes of one KV block of 16 tokens of the test checkpoint (float32, every layer)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(path))
    head = cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    return 2 * 16 * kv_heads * head * 4 * cfg.num_hidden_layers


def test_rows_skip_entries_a_preempted_request_has() -> None:
    request = Request("r", list(range(40)), SamplingParams(prompt_logprobs=2), arrival_index=0)
    assert request.prompt_logprobs is not None
    request.prompt_logprobs.extend([{1: -1.0}] * 20)  # computed before a preemption
    chunks = [ScheduledRequest(request, 0, 16), ScheduledRequest(request, 16, 16),
              ScheduledRequest(request, 32, 8)]
    spans = []
    for chunk in chunks:
        rows = plan_prompt_rows([chunk], np.array([5]), torch.device("cpu"))
        spans.append(None if rows is None else (rows.first_positions, rows.indices.tolist()))
    # Chunk 1: nothing new; chunk 2: positions 20..31 at batch rows 5 + 4 ..; chunk 3:
    # positions 32..38 (39, the last, predicts the first generated token).
    assert spans == [None, ((20,), list(range(9, 21))), ((32,), list(range(5, 12)))]
    assert request.needs_prompt_logprobs


@pytest.mark.parametrize("value", [-1, "2", 1.5, 21])
def test_bad_values_name_the_field(llm: LLM, value: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="prompt_logprobs"):
        llm.generate(["Hello"], SamplingParams(temperature=0, prompt_logprobs=value))


def test_token_logprobs_in_blocks_equal_one_log_softmax() -> None:
    from pagedcore.engine.sampling.prompt_logprobs import token_logprobs

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(600, 50, generator=g) * 4  # more rows than one block
    targets = torch.randint(0, 50, (600,), generator=g)
    counts = [i % 4 for i in range(600)]
    got = token_logprobs(logits, targets, counts)
    full = logits.log_softmax(-1)
    for i in (0, 255, 256, 599):
        row, t = full[i], int(targets[i])
        want = {int(j): float(row[j]) for j in row.topk(counts[i]).indices} if counts[i] else {}
        want[t] = float(row[t])
        assert got[i].keys() == want.keys()
        assert all(abs(got[i][j] - v) < 1e-5 for j, v in want.items())
        assert got[i].rank == 1 + int((row > row[t]).sum())
