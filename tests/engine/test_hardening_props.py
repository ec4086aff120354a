"""Property tests of the engine's edge (issue #27): generated sampling parameters, prompts
and request sequences, valid and invalid. An invalid one is rejected before any work with a
message naming the field; a valid batch's greedy outputs are unchanged by a rejected or failed
neighbour; no block leaks after any example."""

from __future__ import annotations

import functools
import math
import re
from typing import Any

from engine_helpers import assert_no_leak, make_models
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedcore import LLM, SamplingParams

VOCAB = 128  # tiny_config's vocabulary

_floats = st.floats(allow_nan=True, allow_infinity=True)
_junk = st.one_of(st.text(max_size=3), st.booleans(), st.binary(max_size=2))

VALID: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": st.integers(1, 1000),
    "temperature": st.one_of(st.just(0), st.floats(0.0, 5.0)),
    "top_k": st.one_of(st.none(), st.just(-1), st.just(0), st.integers(1, 100)),
    "top_p": st.floats(0.0, 1.0, exclude_min=True),
    "min_p": st.floats(0.0, 1.0),
    "seed": st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    "stop_token_ids": st.one_of(st.none(), st.lists(st.integers(0, 1000), max_size=3),
                                st.tuples(st.integers(0, 9))),
    "ignore_eos": st.booleans(),
    "logprobs": st.one_of(st.none(), st.integers(0, 20)),
    "n": st.integers(1, 4),
    "priority": st.integers(-10, 10),
    "cache_salt": st.one_of(st.none(), st.text(max_size=5)),
    "presence_penalty": st.floats(-2.0, 2.0),
    "frequency_penalty": st.floats(-2.0, 2.0),
    "repetition_penalty": st.floats(0.01, 5.0),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3)),
    "logit_bias": st.one_of(st.none(), st.dictionaries(st.integers(0, 99),
                                                       st.floats(-100.0, 100.0), max_size=3)),
}
INVALID: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": st.one_of(st.integers(max_value=0), _floats, _junk),
    "temperature": st.one_of(st.floats(max_value=-1e-9), st.just(math.nan), st.just(math.inf),
                             _junk),
    "top_k": st.one_of(st.integers(max_value=-2), _floats, _junk),
    "top_p": st.one_of(st.floats(max_value=0.0), st.floats(min_value=1.0001),
                       st.just(math.nan), _junk),
    "min_p": st.one_of(st.floats(max_value=-1e-9), st.floats(min_value=1.0001),
                       st.just(math.nan), _junk),
    "seed": st.one_of(st.integers(max_value=-1), st.integers(min_value=2**64), _floats, _junk),
    "stop_token_ids": st.one_of(
        st.text(max_size=4), st.binary(max_size=2), st.integers(),
        st.lists(st.integers(max_value=-1), min_size=1, max_size=2),
        st.lists(_floats, min_size=1, max_size=2),
        st.lists(st.booleans(), min_size=1, max_size=2),
    ),
    "ignore_eos": st.one_of(st.text(max_size=3), st.integers(), st.none(), _floats),
    "logprobs": st.one_of(st.integers(max_value=-1), _floats, _junk),
    "n": st.one_of(st.integers(max_value=0), _floats, _junk),
    "priority": st.one_of(_floats, _junk, st.none()),
    "cache_salt": st.one_of(st.binary(max_size=3), st.integers(), _floats),
    "presence_penalty": st.one_of(st.floats(min_value=2.0001), st.floats(max_value=-2.0001),
                                  st.just(math.nan), _junk),
    "frequency_penalty": st.one_of(st.floats(min_value=2.0001), st.just(math.inf), _junk),
    "repetition_penalty": st.one_of(st.floats(max_value=0.0), st.just(math.nan), _junk),
    "stop": st.one_of(st.integers(), st.lists(st.integers(), min_size=1, max_size=2)),
    "logit_bias": st.one_of(st.integers(), st.dictionaries(st.integers(0, 9),
                                                           st.floats(min_value=100.01),
                                                           min_size=1, max_size=2)),
}


@st.composite
def sampling_kwargs(draw: st.DrawFn) -> tuple[dict[str, Any], set[str]]:
    """Some fields, each valid or invalid; the names of the invalid ones."""
    names = draw(st.sets(st.sampled_from(sorted(VALID)), max_size=5))
    kwargs: dict[str, Any] = {}
    bad: set[str] = set()
    for name in sorted(names):
        if draw(st.booleans()):
            kwargs[name] = draw(INVALID[name])
            bad.add(name)
        else:
            kwargs[name] = draw(VALID[name])
    return kwargs, bad


@settings(max_examples=300, deadline=None)
@given(sampling_kwargs())
def test_sampling_params_reject_exactly_the_bad_fields(
    case: tuple[dict[str, Any], set[str]],
) -> None:
    kwargs, bad = case
    if not bad:
        params = SamplingParams(**kwargs)
        assert params.replace() == params  # re-validates cleanly
        return
    try:
        SamplingParams(**kwargs)
    except ValueError as exc:
        message = str(exc)
    else:
        raise AssertionError(f"accepted invalid {sorted(bad)}: {kwargs}")
    assert message.startswith("invalid SamplingParams: ")
    named = set(re.findall(r"(?:^|: |; )([a-z_]+) must", message.split(": ", 1)[1]))
    named |= set(re.findall(r"^invalid SamplingParams: ([a-z_]+) must", message))
    assert named == bad, message


# ---- request sequences against one engine ---------------------------------------------------

BAD_PROMPTS: list[tuple[Any, str]] = [
    ({"prompt": None}, "'prompt' must be a str"),
    (b"\x01\x02", "raw bytes"),
    ([], "empty"),
    ({"prompt_token_ids": []}, "empty"),
    ({}, "needs 'prompt_token_ids' or 'prompt'"),
    (None, "must be a str, a list of token ids"),
    (3.0, "must be a str, a list of token ids"),
]


@st.composite
def bad_prompt(draw: st.DrawFn) -> tuple[Any, str]:
    """A prompt the engine must reject, and (part of) the message that names why."""
    kind = draw(st.integers(0, 3))
    good = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6))
    at = draw(st.integers(0, len(good)))
    if kind == 0:
        return draw(st.sampled_from(BAD_PROMPTS))
    if kind == 1:
        bad_id: Any = draw(st.one_of(st.integers(max_value=-1), st.integers(min_value=VOCAB)))
        return [*good[:at], bad_id, *good[at:]], "outside the vocabulary"
    bad_id = draw(st.one_of(st.floats(), st.booleans()))
    return [*good[:at], bad_id, *good[at:]], "token ids must be ints"


GOOD_PROMPTS = st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=10)

# One entry of a request sequence: ("good", prompt, max_tokens) | ("bad_prompt", prompt, msg)
# | ("over_bounds", params, msg) | ("fails", prompt, max_tokens): passes the edge, then its
# sampler setup raises inside the step (a seed forced past validation).
ENTRY = st.one_of(
    st.tuples(st.just("good"), GOOD_PROMPTS, st.integers(1, 4)),
    bad_prompt().map(lambda pm: ("bad_prompt", pm[0], pm[1])),
    st.one_of(
        st.integers(21, 10**9).map(
            lambda k: ("over_bounds", SamplingParams(logprobs=k), "max_logprobs=20")),
        st.integers(257, 10**6).map(
            lambda n: ("over_bounds", SamplingParams(n=n), "max_n=256")),
    ),
    st.tuples(st.just("fails"), GOOD_PROMPTS, st.integers(1, 4)),
)


def _engine(model: Any) -> LLM:
    return LLM(model, device="cpu", block_size=4, max_model_len=32, max_num_batched_tokens=24,
               max_num_seqs=4, kv_cache_memory_bytes=1 << 20)


@functools.cache
def _engines() -> tuple[LLM, LLM]:
    """(the engine under test, a reference engine that runs each request alone)."""
    model = make_models("llama", seed=3)[2]
    return _engine(model), _engine(model)


@functools.cache
def _alone(prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    ref = _engines()[1]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return list(ref.generate([list(prompt)], params)[0].outputs[0].token_ids)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ENTRY, min_size=1, max_size=5))
def test_bad_or_failing_neighbours_leave_valid_outputs_unchanged(entries: list[Any]) -> None:
    llm, _ = _engines()
    expected: dict[str, list[int]] = {}
    failing: set[str] = set()
    for i, (kind, value, extra) in enumerate(entries):
        rid = f"r{i}"
        queued = set(llm.scheduler.requests)
        if kind in ("bad_prompt", "over_bounds"):
            prompt, params = (value, None) if kind == "bad_prompt" else ([5, 6], value)
            try:
                llm.add_request(rid, prompt, params)
            except ValueError as exc:
                assert extra in str(exc), (extra, str(exc))
            else:
                raise AssertionError(f"accepted {kind} {value!r}")
            assert set(llm.scheduler.requests) == queued  # nothing queued
            continue
        greedy = SamplingParams(max_tokens=extra, temperature=0.0, ignore_eos=True)
        if kind == "fails":
            params = SamplingParams(max_tokens=extra, temperature=1.0, ignore_eos=True)
            llm.add_request(rid, value, params)
            forced = params.replace()
            object.__setattr__(forced, "seed", "not a seed")
            llm.scheduler.requests[rid].params = forced
            failing.add(rid)
        else:
            llm.add_request(rid, value, greedy)
            expected[rid] = _alone(tuple(value), extra)
    done: dict[str, Any] = {}
    for _ in range(100):
        if not llm.has_unfinished_requests():
            break
        done.update((o.request_id, o) for o in llm.step() if o.finished)
    assert not llm.has_unfinished_requests()
    for rid, tokens in expected.items():
        assert list(done[rid].outputs[0].token_ids) == tokens, rid
        assert done[rid].outputs[0].finish_reason == "length"
    for rid in failing:
        assert done[rid].outputs[0].finish_reason == "error"
        assert "sampler setup failed" in (done[rid].error or "")
    assert_no_leak(llm)
