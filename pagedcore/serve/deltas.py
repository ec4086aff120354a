"""What the engine loop hands the front end per sequence: `StreamDelta`s and `CoreError`s.

Both are small and picklable: with the engine in its own process they cross a pipe, one list
of them per step. A consumer that fell behind merges the deltas waiting for it into one
(`merge_deltas`), so a slow client gets fewer, larger chunks and never holds the engine up.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import attrs

from pagedcore.serve.errors import (
    BadRequestError,
    EngineDeadError,
    RequestFailedError,
    ServeError,
    ShuttingDownError,
)

if TYPE_CHECKING:
    from pagedcore.engine.outputs import Logprob

__all__ = ["CoreError", "StreamDelta", "merge_deltas", "merge_raw_deltas"]


class StreamDelta(NamedTuple):
    """What one sequence produced since the previous delta (a named tuple: it pickles about
    ten times faster than an attrs class, and a step sends hundreds).

    Attributes
    ----------
    request_id:
        The engine request id.
    text:
        New text (complete characters only; the part that could still become a stop string is
        held back).
    token_ids:
        New token ids.
    logprobs:
        Per new token ``{token_id: Logprob}`` (the sampled token and the top ones), or None.
    finish_reason:
        None while running; then ``"stop"`` (EOS, a stop token or a stop string), ``"length"``
        (max_tokens or the model length) or ``"abort"`` (the server stopped it).
    stop_reason:
        The EOS / stop token id or the stop string that ended the sequence, or None.
    num_prompt_tokens, num_cached_tokens, num_generated_tokens:
        Prompt tokens, those served from the prefix cache, tokens generated so far (all of the
        sequence, not only this delta's).
    prompt_logprobs:
        With ``SamplingParams.prompt_logprobs``: `RequestOutput.prompt_logprobs`, in the first
        delta after the prompt was computed only; else None.
    """

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_generated_tokens: int
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


def merge_deltas(first: StreamDelta, later: StreamDelta) -> StreamDelta:
    """One delta holding what `first` and then `later` (of the same sequence) hold."""
    logprobs = None
    if first.logprobs is not None or later.logprobs is not None:
        logprobs = (first.logprobs or []) + (later.logprobs or [])
    prompt_logprobs = first.prompt_logprobs if later.prompt_logprobs is None \
        else later.prompt_logprobs
    return later._replace(text=first.text + later.text,
                          token_ids=first.token_ids + later.token_ids, logprobs=logprobs,
                          prompt_logprobs=prompt_logprobs)


def merge_raw_deltas(raws: Sequence[tuple[Any, ...]]) -> StreamDelta:
    """One `StreamDelta` holding what the raw deltas `raws` (`StreamDelta`'s fields, of one
    sequence, oldest first, at least one) hold: their tokens, text and logprobs concatenated
    once (not pairwise: a stream far behind may have hundreds waiting), the rest from the
    last (the prompt logprobs from the last that has them)."""
    last = raws[-1]
    if len(raws) == 1:
        return StreamDelta._make(last)
    tokens: list[int] = []
    for raw in raws:
        tokens += raw[2]
    text = "".join([raw[1] for raw in raws])
    logprobs = None
    if any(raw[3] is not None for raw in raws):
        logprobs = [entry for raw in raws for entry in (raw[3] or ())]
    prompt_logprobs = next((raw[9] for raw in reversed(raws) if raw[9] is not None), None)
    return StreamDelta(last[0], text, tokens, logprobs, last[4], last[5], last[6], last[7],
                       last[8], prompt_logprobs)


#: `CoreError.kind` -> the `ServeError` the consumer raises.
_KINDS: dict[str, type[ServeError]] = {
    "bad_request": BadRequestError,
    "failed": RequestFailedError,
    "dead": EngineDeadError,
    "shutdown": ShuttingDownError,
}


@attrs.frozen
class CoreError:
    """A failure of one sequence, as data (exceptions do not pickle their fields reliably).

    ``kind``: ``"bad_request"`` (the engine refused it; ``param`` names the field),
    ``"failed"`` (a step computing it failed), ``"dead"`` (the engine loop stopped after a
    failure), ``"shutdown"`` (the server shut down).
    """

    kind: str
    message: str
    param: str | None = None

    def to_exception(self) -> ServeError:
        """The `ServeError` the request's consumer raises."""
        cls = _KINDS[self.kind]
        if cls is BadRequestError:
            return BadRequestError(self.message, param=self.param)
        return cls(self.message)
