"""The LLM facade: bad input, abort, streaming, n > 1, stop tokens, the demo model and CLI."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from click.testing import CliRunner
from engine_helpers import assert_no_leak, make_models, random_prompts

from pagedcore import LLM, SamplingParams
from pagedcore.cli import main

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    _config, _ref, eng = make_models("llama")
    return LLM(eng, device="cpu", block_size=4, max_model_len=48, max_num_batched_tokens=32,
               kv_cache_memory_bytes=1 << 20)


def test_bad_input_is_rejected_clearly_and_engine_keeps_serving(llm: LLM) -> None:
    llm.add_request("good", random_prompts([6])[0], GREEDY)
    with pytest.raises(ValueError, match=r"60 tokens, more than max_model_len=48"):
        llm.add_request("long", [5] * 60, GREEDY)
    with pytest.raises(ValueError, match="empty"):
        llm.add_request("empty", [], GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.add_request("oov", [5, 100000], GREEDY)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.add_request("text", "hello", GREEDY)
    with pytest.raises(ValueError, match="already in the engine"):
        llm.add_request("good", [5, 6], GREEDY)
    with pytest.raises(KeyError, match="unknown or already finished request 'nope'"):
        llm.abort("nope")
    with pytest.raises(ValueError, match="SamplingParams for"):
        llm.generate([[5, 6], [7, 8]], [GREEDY])
    # A bad prompt in a batch queues nothing.
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[5, 6], [5] * 99], GREEDY)
    finished = []
    while llm.has_unfinished_requests():
        finished += [o for o in llm.step() if o.finished]
    assert [o.request_id for o in finished] == ["good"]
    assert len(finished[0].outputs[0].token_ids) == 12
    assert_no_leak(llm)


def test_kv_budget_too_small_names_the_numbers() -> None:
    _config, _ref, eng = make_models("llama")
    with pytest.raises(ValueError, match=r"(?s)max_model_len.*fit"):
        LLM(eng, device="cpu", block_size=4, max_model_len=400, kv_cache_memory_bytes=20_000)


def test_abort_mid_generation_frees_blocks(llm: LLM) -> None:
    llm.add_request("a", random_prompts([9], seed=2)[0], SamplingParams(max_tokens=40,
                                                                      ignore_eos=True))
    llm.add_request("b", random_prompts([5], seed=3)[0], GREEDY)
    llm.step()
    llm.step()
    out = llm.abort("a")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert 1 <= len(out.outputs[0].token_ids) < 40
    while llm.has_unfinished_requests():
        llm.step()
    assert_no_leak(llm)


def test_stream_matches_generate(llm: LLM) -> None:
    prompts = random_prompts([4, 11], seed=4)
    final = llm.generate(prompts, GREEDY)
    seen: dict[str, list[int]] = {}
    last: dict[str, Any] = {}
    for out in llm.stream(prompts, GREEDY):  # delta outputs: the new tokens only
        assert out.delta
        seen.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        last[out.request_id] = out
    assert all(o.finished for o in last.values())
    assert sorted(seen.values()) == sorted(o.outputs[0].token_ids for o in final)
    assert_no_leak(llm)


def test_n_samples_share_the_prompt_and_seeds_reproduce(llm: LLM) -> None:
    prompt = random_prompts([13], seed=5)[0]
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=11, n=3, ignore_eos=True)
    [out] = llm.generate([prompt], params)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 10 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # different seeds per sample
    assert out.num_cached_tokens == 12  # later samples hit the first one's prompt blocks
    [again] = llm.generate([prompt], params)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    assert_no_leak(llm)


def test_stop_token_ids_and_metrics(llm: LLM) -> None:
    prompt = random_prompts([7], seed=6)[0]
    [free] = llm.generate([prompt], GREEDY)
    tokens = free.outputs[0].token_ids
    stop = tokens[4]
    [stopped] = llm.generate([prompt], GREEDY.replace(stop_token_ids=[stop]))
    first = tokens.index(stop)
    assert stopped.outputs[0].token_ids == tokens[: first + 1]
    assert stopped.outputs[0].finish_reason == "stop"
    m = stopped.metrics
    assert m.time_to_first_token is not None and m.time_to_first_token >= 0
    assert m.finished_time is not None and m.finished_time >= m.arrival_time


def test_demo_model_text_and_cli() -> None:
    llm = LLM("demo", device="cpu", max_model_len=128, max_num_batched_tokens=128)
    [out] = llm.generate(["Hello, paged world"], SamplingParams(max_tokens=5, temperature=0.0),
                         use_tqdm=True)
    assert out.prompt == "Hello, paged world"
    assert out.prompt_token_ids[0] == 256 and len(out.prompt_token_ids) == 19
    assert isinstance(out.outputs[0].text, str)
    runner = CliRunner()
    result = runner.invoke(main, ["generate", "--prompt", "hi", "--max-tokens", "3",
                                  "--device", "cpu", "--max-model-len", "64"])
    assert result.exit_code == 0, result.output
    assert "3 tokens" in result.output
    result = runner.invoke(main, ["generate", "--token-ids", "1,2,x", "--device", "cpu"])
    assert result.exit_code != 0 and "comma-separated" in result.output
    # The reference backend, as a CPU user gets it: in a whole-suite run the Triton tests'
    # conftest sets TRITON_INTERPRET=1, which makes `triton` selectable here (in the
    # interpreter the demo took 279 s of CI).
    result = runner.invoke(main, ["demo", "--num-requests", "6", "--device", "cpu",
                                  "--backend", "reference"])
    assert result.exit_code == 0, result.output
    assert "TTFT p50 / p99" in result.output and "preemptions" in result.output


def test_local_checkpoint_directory(tmp_path: Any) -> None:
    _config, ref, _eng = make_models("qwen3")
    ref.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), device="cpu", block_size=4, max_model_len=64,
              kv_cache_memory_bytes=1 << 20)
    prompt = random_prompts([9], seed=12)[0]
    [out] = llm.generate([prompt], GREEDY)
    expected = ref.generate(torch.tensor([prompt]), max_new_tokens=12,
                            do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out.outputs[0].token_ids == expected[0, len(prompt):].tolist()
    with pytest.raises(ValueError, match="cannot load model"):
        LLM(str(tmp_path / "missing"), device="cpu")


def test_max_model_len_beyond_positions_is_rejected() -> None:
    _config, _ref, eng = make_models("llama")
    with pytest.raises(ValueError, match=r"max_model_len=1000 exceeds .*=512"):
        LLM(eng, device="cpu", max_model_len=1000)
