"""Issue #27, engine half: bad input is rejected at the edge (naming the field, before any
work), and a request that still fails inside a step fails alone (its neighbours' outputs are
unchanged, its blocks freed, nothing left hanging)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from engine_helpers import assert_no_leak, make_models, random_prompts

from pagedcore import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True, seed=3)


@pytest.fixture(scope="module")
def model() -> Any:
    return make_models("llama")[2]


def make_llm(model: Any, **kw: Any) -> LLM:
    return LLM(model, device="cpu", block_size=4, max_model_len=48, max_num_batched_tokens=32,
               kv_cache_memory_bytes=1 << 20, **kw)


@pytest.fixture(scope="module")
def llm(model: Any) -> LLM:
    return make_llm(model)


def drain(llm: LLM, limit: int = 200) -> dict[str, Any]:
    """Step until nothing is left (a bounded number of steps: a wedged engine fails)."""
    done: dict[str, Any] = {}
    for _ in range(limit):
        if not llm.has_unfinished_requests():
            return done
        for out in llm.step():
            if out.finished:
                done[out.request_id] = out
    raise AssertionError(f"engine still busy after {limit} steps: {llm.stats()}")


def tokens(out: Any) -> list[int]:
    return list(out.outputs[0].token_ids)


# ---- SamplingParams: every field by type and value ----------------------------------------

BAD_PARAMS = [
    ({"temperature": "0.5"}, "temperature", TypeError),
    ({"temperature": math.nan}, "temperature", ValueError),
    ({"seed": "abc"}, "seed must be an int in [0, 2**64 - 1]", TypeError),
    ({"seed": 1.5}, "seed", TypeError),
    ({"seed": 2**70}, "seed", ValueError),
    ({"seed": -1}, "seed", ValueError),
    ({"seed": True}, "seed", TypeError),
    ({"priority": "high"}, "priority", TypeError),
    ({"cache_salt": b"tenant"}, "decode it first", TypeError),
    ({"cache_salt": 5}, "cache_salt", TypeError),
    ({"stop_token_ids": "50256"}, "did you mean [50256]", TypeError),
    ({"stop_token_ids": [1.0]}, "stop_token_ids", TypeError),
    ({"stop_token_ids": [True]}, "stop_token_ids", TypeError),
    ({"stop_token_ids": [-2]}, "stop_token_ids", ValueError),
    ({"ignore_eos": "no"}, "ignore_eos must be True or False", TypeError),
    ({"ignore_eos": 1}, "ignore_eos", TypeError),
    ({"logprobs": True}, "logprobs", TypeError),
    ({"logprobs": 2.0}, "logprobs", TypeError),
    ({"n": True}, "n must be", TypeError),
    ({"n": 2.5}, "n must be", TypeError),
    ({"max_tokens": "8"}, "pass 8 without quotes", TypeError),
    ({"max_tokens": 8.0}, "max_tokens", TypeError),
    ({"top_k": 3.0}, "top_k", TypeError),
    ({"top_p": math.nan}, "top_p", ValueError),
    ({"top_p": "1"}, "top_p", TypeError),
    ({"min_p": math.inf}, "min_p", ValueError),
    ({"logit_bias": {"\u00b2": 1.0}}, "logit_bias", TypeError),  # isdigit, but not int()'s
]


@pytest.mark.parametrize(("kwargs", "names", "kind"), BAD_PARAMS)
def test_bad_sampling_params_are_rejected_naming_the_field(
    kwargs: dict[str, Any], names: str, kind: type[Exception]
) -> None:
    with pytest.raises(kind) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, ValueError)  # every rejection is a ValueError too
    message = str(info.value)
    assert message.startswith("invalid SamplingParams: "), message
    assert names in message, message


def test_rejections_name_their_fields_in_check_order() -> None:
    """`InvalidArgumentError.fields`: what a server reports as the error's ``param``."""
    with pytest.raises(ValueError) as info:
        SamplingParams(seed=-1, top_p=2.0, logit_bias={"x": 1.0})
    assert info.value.fields == ("top_p", "seed", "logit_bias")  # type: ignore[attr-defined]


def test_token_ids_outside_the_vocabulary_are_refused(llm: LLM, model: Any) -> None:
    """A mask of only unknown ids would leave no token to sample (every logit -inf), a bias
    on one biases nothing: both are refused, naming the field, and nothing is queued."""
    vocab = int(model.config.vocab_size)
    for params, field, bad in (
            (SamplingParams(allowed_token_ids=[3, vocab]), "allowed_token_ids", vocab),
            (SamplingParams(logit_bias={vocab + 5: 1.0}), "logit_bias", vocab + 5)):
        with pytest.raises(ValueError, match=rf"{field} has token ids \[{bad}\] outside"):
            llm.add_request("x", [5, 6], params)
        with pytest.raises(ValueError, match=field):
            llm.generate([[5, 6]], params)
    assert not llm.has_unfinished_requests() and not llm.scheduler.requests


def test_valid_sampling_params_are_normalised_not_coerced() -> None:
    import numpy as np

    p = SamplingParams(stop_token_ids=[np.int64(5), 7], seed=2**64 - 1, temperature=0,
                       max_tokens=np.int32(3))
    assert p.stop_token_ids == (5, 7) and p.seed == 2**64 - 1
    assert type(p.max_tokens) is int and p.max_tokens == 3 and p.greedy


# ---- engine bounds --------------------------------------------------------------------------


def test_logprobs_and_n_are_bounded_by_the_engine(llm: LLM, model: Any) -> None:
    assert (llm.max_logprobs, llm.max_n) == (20, 256)
    with pytest.raises(ValueError, match=r"logprobs=21 exceeds the engine's max_logprobs=20"):
        llm.add_request("x", [5, 6], SamplingParams(logprobs=21))
    with pytest.raises(ValueError, match=r"n=257 exceeds the engine's max_n=256"):
        llm.generate([[5, 6]], SamplingParams(n=257))
    assert not llm.has_unfinished_requests() and not llm.scheduler.requests
    # Configurable.
    big = make_llm(model, max_logprobs=40, max_n=300)
    out = big.generate([[5, 6]], SamplingParams(max_tokens=1, logprobs=30, temperature=0))
    assert len(out[0].outputs[0].logprobs[0]) == 30


def test_sampling_params_of_the_wrong_type_are_named(llm: LLM) -> None:
    with pytest.raises(TypeError, match=r"must be a SamplingParams.*SamplingParams\(\*\*"):
        llm.add_request("x", [5, 6], {"max_tokens": 3})  # type: ignore[arg-type]
    assert not llm.scheduler.requests


# ---- prompts --------------------------------------------------------------------------------

BAD_PROMPTS = [
    ({"prompt": None}, "'prompt' must be a str"),
    (b"hello", "raw bytes"),
    ([1.0, 2.0], "token ids must be ints"),
    ([3, True], "token ids must be ints"),
    ([3, -1], "outside the vocabulary"),
    ([3, 128], "outside the vocabulary"),
    ([], "empty"),
    ({"prompt_token_ids": [2.5]}, "token ids must be ints"),
    ({"text": "hi"}, "needs 'prompt_token_ids' or 'prompt'"),
    (7, "must be a str, a list of token ids"),
    (torch.tensor([3, 1], dtype=torch.bool), "a Tensor of bools"),  # not the ids [1, 1]
]


@pytest.mark.parametrize(("prompt", "message"), BAD_PROMPTS)
def test_bad_prompts_are_rejected_before_any_work(llm: LLM, prompt: Any, message: str) -> None:
    free = llm.kv_cache_manager.num_free_blocks
    with pytest.raises(ValueError, match=message):
        llm.add_request("bad", prompt, GREEDY)
    with pytest.raises(ValueError, match=message):
        llm.generate([[5, 6, 7], prompt], GREEDY)  # the good one is not queued either
    assert not llm.scheduler.requests and not llm.has_unfinished_requests()
    assert llm.kv_cache_manager.num_free_blocks == free


def test_prompts_none_is_named(llm: LLM) -> None:
    with pytest.raises(TypeError, match="prompts must be one prompt"):
        llm.generate(None)  # type: ignore[arg-type]


def test_switches_and_ids_of_the_wrong_type_are_named(llm: LLM) -> None:
    """A truthy string is no switch ("no" would turn it on), a dict no delta sink, a list no
    request id; each is a TypeError naming the argument, and nothing changes."""
    before = llm.async_scheduling
    with pytest.raises(TypeError, match="enabled must be True, False or None"):
        llm.set_async_scheduling("no")  # type: ignore[arg-type]
    assert llm.async_scheduling == before
    with pytest.raises(TypeError, match="delta must be True or False"):
        llm.add_request("x", [5, 6], GREEDY, delta="no")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="finished_only must be True or False"):
        llm.step(finished_only="no")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="deltas must be a list"):
        llm.step(deltas={})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="request_id must be a str"):
        llm.abort(["x"])  # type: ignore[arg-type]
    assert not llm.has_unfinished_requests() and not llm.scheduler.requests


# ---- LLM(...) arguments, checked before the model is touched -------------------------------

BAD_ARGS = [
    ({"block_size": "16"}, "block_size"),
    ({"block_size": 0}, "block_size"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_num_batched_tokens": 1.5}, "max_num_batched_tokens"),
    ({"max_model_len": -4}, "max_model_len"),
    ({"gpu_memory_utilization": 0}, "gpu_memory_utilization must be a float in (0, 1]"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"gpu_memory_utilization": math.nan}, "gpu_memory_utilization"),
    ({"kv_cache_memory_bytes": 0}, "kv_cache_memory_bytes must be an int > 0"),
    ({"scheduling_policy": "lifo"}, "scheduling_policy must be one of"),
    ({"seed": -1}, "seed"),
    ({"seed": "0"}, "seed"),
    ({"enable_prefix_caching": "yes"}, "enable_prefix_caching must be True or False"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"hash_algo": "md5"}, "hash_algo must be one of"),
    ({"hash_seed": 1.5}, "hash_seed"),
    ({"max_logprobs": -1}, "max_logprobs"),
    ({"max_n": 0}, "max_n"),
    ({"tokenizer": "gpt2"}, "tokenizer must have encode"),
    ({"cudagraph_capture_sizes": [0]}, "cudagraph_capture_sizes"),
    ({"device": "foo"}, "device='foo' is not a device name"),
    ({"device": "meta"}, "'cpu' or 'cuda'"),
    ({"device": 1.5}, "device must be None"),
    ({"dtype": "int8"}, "dtype='int8' is not one of"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_ARGS)
def test_bad_engine_arguments_are_named_before_loading(
    kwargs: dict[str, Any], message: str
) -> None:
    # `model` is not loadable at all: the error must come from the argument check first.
    with pytest.raises(ValueError) as info:
        LLM(object(), **kwargs)  # type: ignore[arg-type]
    assert message in str(info.value), str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_requested_without_cuda_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"CUDA is not available here.*device='cpu'"):
        LLM(object(), device="cuda")  # type: ignore[arg-type]


def test_hash_seed_and_algo_reach_the_kv_cache_manager(model: Any) -> None:
    from pagedcore.kv_cache.hashing import make_hash_function, root_hash

    llm = make_llm(model, hash_seed=1234)
    roots = {h._root for h in llm.kv_cache_manager._hashers.values()}
    assert roots == {root_hash(make_hash_function("sha256"), 1234)}
    pytest.importorskip("xxhash")
    llm = make_llm(model, hash_algo="xxhash", hash_seed=b"s")
    roots = {h._root for h in llm.kv_cache_manager._hashers.values()}
    assert roots == {root_hash(make_hash_function("xxhash"), b"s")}


# ---- a bad request fails alone ------------------------------------------------------------


def _force(params: SamplingParams, **fields: Any) -> SamplingParams:
    """A copy with fields set past validation (what a bug elsewhere could produce)."""
    forced = params.replace()
    for name, value in fields.items():
        object.__setattr__(forced, name, value)
    return forced


@pytest.fixture(scope="module")
def reference(model: Any) -> dict[str, list[int]]:
    prompts = random_prompts([9, 6, 11], seed=27)
    outs = make_llm(model).generate(prompts, [GREEDY, SAMPLED, GREEDY])
    return {f"p{i}": tokens(o) for i, o in enumerate(outs)} | {
        f"prompt{i}": p for i, p in enumerate(prompts)  # type: ignore[misc]
    }


def _add_neighbours(llm: LLM, reference: dict[str, Any]) -> None:
    llm.add_request("p0", reference["prompt0"], GREEDY)
    llm.add_request("p1", reference["prompt1"], SAMPLED)


def _check_neighbours(done: dict[str, Any], reference: dict[str, Any]) -> None:
    for rid in ("p0", "p1"):
        assert done[rid].outputs[0].finish_reason == "length"
        assert tokens(done[rid]) == reference[rid], rid


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_uncomparable_priority_or_bad_salt_fails_alone_and_never_wedges(
    model: Any, reference: dict[str, Any], policy: str
) -> None:
    llm = make_llm(model, scheduling_policy=policy)
    _add_neighbours(llm, reference)
    llm.add_request("bad", reference["prompt2"], GREEDY)
    bad = llm.scheduler.requests["bad"]
    if policy == "priority":
        bad.params = _force(GREEDY, priority="high")
    else:
        bad.cache_salt = b"tenant"  # type: ignore[assignment]
    done = drain(llm)
    assert done["bad"].outputs[0].finish_reason == "error"
    assert done["bad"].error is not None
    assert ("priority" if policy == "priority" else "prefix-cache") in done["bad"].error
    _check_neighbours(done, reference)
    assert_no_leak(llm)


def test_seed_that_the_sampler_rejects_fails_only_its_request(
    model: Any, reference: dict[str, Any]
) -> None:
    llm = make_llm(model)
    _add_neighbours(llm, reference)
    llm.add_request("bad", reference["prompt2"], SAMPLED)
    llm.scheduler.requests["bad"].params = _force(SAMPLED, seed="abc")
    done = drain(llm)
    assert done["bad"].outputs[0].finish_reason == "error"
    assert "sampler setup failed" in (done["bad"].error or "")
    _check_neighbours(done, reference)
    assert_no_leak(llm)


def test_largest_seed_with_several_samples_runs(llm: LLM) -> None:
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, seed=2**64 - 1, n=2))
    assert [c.finish_reason for c in out[0].outputs] == ["length", "length"]
    assert_no_leak(llm)


class _Tokenizer:
    """Decodes ids as text; raises for outputs that start with `poison`."""

    def __init__(self, poison: int | None = None) -> None:
        self.poison = poison

    def encode(self, text: str) -> list[int]:
        return [3 + ord(c) % 100 for c in text]

    def decode(self, ids: list[int]) -> str:
        if self.poison is not None and ids[:1] == [self.poison]:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "poisoned")
        return " ".join(map(str, ids))


def test_decode_failure_fails_only_its_request_and_leaves_no_orphan(
    model: Any, reference: dict[str, Any]
) -> None:
    poison = reference["p2"][0]
    assert poison not in (reference["p0"][0], reference["p1"][0])
    llm = make_llm(model, tokenizer=_Tokenizer(poison))
    _add_neighbours(llm, reference)
    llm.add_request("bad", reference["prompt2"], GREEDY)
    done = drain(llm)
    assert done["bad"].outputs[0].finish_reason == "error"
    assert "UnicodeDecodeError" in (done["bad"].error or "")
    assert tokens(done["bad"]) == reference["p2"][:1]  # what it had is kept
    _check_neighbours(done, reference)
    assert done["p0"].outputs[0].text == " ".join(map(str, reference["p0"]))
    assert not llm.has_unfinished_requests()
    assert_no_leak(llm)


def test_abort_never_reraises_a_decode_failure(model: Any) -> None:
    tokenizer = _Tokenizer()
    llm = make_llm(model, tokenizer=tokenizer)
    llm.add_request("a", [5, 6, 7], GREEDY)
    llm.step()
    tokenizer.poison = llm.scheduler.requests["a"].output_token_ids[0]
    out = llm.abort("a")
    assert out.finished and out.outputs[0].text == "" and "decode" not in out.outputs[0].text
    assert not llm.has_unfinished_requests()
    assert_no_leak(llm)


def test_add_request_with_samples_is_atomic(llm: LLM) -> None:
    llm.add_request("x#1", [5, 6], GREEDY)
    with pytest.raises(ValueError, match=r"'x#1' \(a sample of this request\)"):
        llm.add_request("x", [7, 8], SamplingParams(n=2, max_tokens=2))
    assert set(llm.scheduler.requests) == {"x#1"}
    llm.abort("x#1")
    assert_no_leak(llm)


def test_failure_while_updating_outputs_leaves_no_orphan(
    model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pagedcore.engine.errors import EngineStepError

    llm = make_llm(model)
    llm.add_request("a", [5, 6, 7], GREEDY)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("stop check exploded")

    monkeypatch.setattr(llm.scheduler, "update_from_output", broken)
    with pytest.raises(EngineStepError, match="stop check exploded") as info:
        llm.step()
    assert [o.outputs[0].finish_reason for o in info.value.outputs] == ["error"]
    assert not llm.has_unfinished_requests()
    assert_no_leak(llm)


def test_a_request_lost_by_the_scheduler_is_no_orphan(llm: LLM) -> None:
    llm.add_request("lost", [5, 6, 7], GREEDY)
    request = llm.scheduler.requests.pop("lost")  # what an internal bug could leave behind
    llm.scheduler.waiting.remove(request)
    assert not llm.has_unfinished_requests()  # a serving loop stops instead of spinning
    with pytest.raises(KeyError):
        llm.abort("lost")
    assert_no_leak(llm)


def test_invalid_argument_errors_are_value_errors() -> None:
    from pagedcore.engine.validation import InvalidArgumentError, InvalidArgumentTypeError

    assert issubclass(InvalidArgumentTypeError, TypeError)
    assert issubclass(InvalidArgumentError, ValueError)


def test_invalid_argument_errors_are_exported_from_pagedcore() -> None:
    import pagedcore
    from pagedcore.engine import validation

    assert pagedcore.InvalidArgumentError is validation.InvalidArgumentError
    assert pagedcore.InvalidArgumentTypeError is validation.InvalidArgumentTypeError
    with pytest.raises(pagedcore.InvalidArgumentTypeError, match="seed"):
        pagedcore.SamplingParams(seed="abc")


def test_requests_carry_their_packed_prompt_for_the_block_hashes(llm: LLM) -> None:
    """A prompt of exact ints is packed once by the prompt check (`Request.prompt_bytes`,
    which the block hashes slice instead of packing again); other forms carry none, and the
    hits are the same either way."""
    import sys
    from array import array

    import numpy as np

    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    try:
        llm.add_request("packed", prompt, GREEDY)
        llm.add_request("numpy", {"prompt_token_ids": np.array(prompt)}, GREEDY)
        sched = llm.scheduler.requests
        want = array("q", prompt).tobytes() if sys.byteorder == "little" else None
        assert sched["packed"].prompt_bytes == want
        assert sched["numpy"].prompt_bytes is None
        assert list(sched["numpy"].all_token_ids) == prompt
    finally:
        for rid in ("packed", "numpy"):
            if rid in llm.scheduler.requests:
                llm.abort(rid)
    outs = llm.generate([prompt, {"prompt_token_ids": np.array(prompt)}], GREEDY)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert outs[1].num_cached_tokens == 8  # two full blocks of 4 hit, by either path
