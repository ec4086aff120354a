"""Prompt token ids are converted at C speed where they can be, with the old results everywhere."""

from __future__ import annotations

import numpy as np
import pytest

from pagedcore.engine.output_builder import tokenize
from pagedcore.engine.sampling.sampling_params import SamplingParams
from pagedcore.engine.scheduling.request import Request


def _ids(prompt: object, vocab: int = 100) -> list[int]:
    text, ids = tokenize(prompt, tokenizer=None, model_name="m", vocab_size=vocab)  # type: ignore[arg-type]
    assert text is None
    assert all(type(t) is int for t in ids)
    return ids


def test_ids_of_every_integer_kind_become_python_ints() -> None:
    assert _ids([5, 0, 99]) == [5, 0, 99]
    assert _ids(np.array([3, 4], dtype=np.int32)) == [3, 4]
    assert _ids([np.int64(7), 2]) == [7, 2]
    assert _ids(range(3)) == [0, 1, 2]


@pytest.mark.parametrize("bad", [[1, True], [2.0, 3], [np.float32(1.0)], [1, "2"]])
def test_ids_that_are_not_ints_are_rejected_not_truncated(bad: list[object]) -> None:
    with pytest.raises(TypeError, match="token ids must be ints, got an element"):
        _ids(bad)


def test_empty_prompt_is_rejected() -> None:
    with pytest.raises(ValueError, match="empty"):
        _ids([])


@pytest.mark.parametrize("bad", [[1, 100], [-1, 2], [2**70]])
def test_ids_outside_the_vocabulary_are_named(bad: list[float]) -> None:
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 100\)"):
        _ids(bad)


def test_request_owns_a_python_int_copy_of_its_prompt() -> None:
    prompt = np.array([1, 2, 3], dtype=np.int64)
    req = Request("r", prompt, SamplingParams(), arrival_index=0)
    prompt[0] = 9
    assert list(req.all_token_ids) == [1, 2, 3]
    assert all(type(t) is int for t in req.all_token_ids)
    assert Request("f", [1.0, 2], SamplingParams(), arrival_index=1).prompt_token_ids == [1, 2]
    req.append_token(4)
    assert req.num_prompt_tokens == 3 and req.output_token_ids == [4]


def test_checked_ids_are_copied_not_shared() -> None:
    """The prompt check hands back a list of its own, and a `Request` built with
    ``checked=True`` (what the engine does with that list) still owns its copy: neither
    the caller's list nor a sibling sample's tokens leak in."""
    prompt = [5, 0, 99]
    ids = _ids(prompt)
    assert ids == prompt and ids is not prompt
    prompt[0] = 7
    assert ids == [5, 0, 99]
    a = Request("a", ids, SamplingParams(), arrival_index=0, checked=True)
    b = Request("b", ids, SamplingParams(), arrival_index=1, checked=True)
    a.append_token(4)
    ids[1] = 3
    assert a.all_token_ids == [5, 0, 99, 4] and b.all_token_ids == [5, 0, 99]
    assert b.num_prompt_tokens == 3 and b.output_token_ids == []
