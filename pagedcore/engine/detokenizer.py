"""The text of generated tokens: incremental detokenization and stop strings across tokens.

`IncrementalDetokenizer` turns the token ids of one sequence, as they arrive, into text deltas
that never split a multi-byte character: over a Hugging Face fast tokenizer it uses
`tokenizers.decoders.DecodeStream` (constant work per token); over anything else with a
``decode`` method it decodes a short window of recent tokens and holds back a trailing
replacement character ("\\ufffd") until the next token completes it.

`StopStringMatcher` finds OpenAI ``stop`` strings in the detokenized text, even when a stop
string spans several tokens, and holds back the text that could still become one, so a client
never sees the start of a stop string that the engine later cuts off.

`TextState` joins the two for one sequence under its `SamplingParams`; `advance_text` feeds it
the sequence's output token ids it has not seen yet (a pure function of the state and the ids,
so any output path, a step-behind one included, can call it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedcore.engine.sampling.sampling_params import SamplingParams

__all__ = [
    "IncrementalDetokenizer", "StopStringMatcher", "TextState", "advance_text",
    "backend_tokenizer",
]

_REPLACEMENT = "\ufffd"


def backend_tokenizer(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` behind a Hugging Face fast tokenizer, or None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - tokenizers ships with transformers
        return None
    return backend if isinstance(backend, Tokenizer) else None


class IncrementalDetokenizer:
    """Text deltas of one sequence's generated tokens, fed a few at a time.

    Parameters
    ----------
    tokenizer:
        A Hugging Face tokenizer (fast ones use `DecodeStream`) or any object with
        ``decode(ids) -> str``; None: every delta is "".
    skip_special_tokens:
        Leave special tokens (EOS, chat markers) out of the text (OpenAI servers do).
    spaces_between_special_tokens:
        With `skip_special_tokens` False: False writes a special token that follows another
        as its bare content (no space the decoder may put before it), as vLLM does.

    Notes
    -----
    The deltas of `add` followed by `flush` concatenate to the text of the whole sequence.
    """

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self._backend = backend_tokenizer(tokenizer)
        self._stream: Any = None
        # Special tokens by id, when adjacent ones must be written bare (see above).
        self._special: dict[int, str] = {}
        self._last_special = False
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            if not skip_special_tokens and not spaces_between_special_tokens:
                self._special = {i: str(t) for i, t in
                                 getattr(tokenizer, "added_tokens_decoder", {}).items()
                                 if getattr(t, "special", False)}
        # DecodeStream path: the ids fed and the text released, and whether the last step
        # held text back (a token ending inside a character holds all its text, whole
        # characters included, until one completes it: `flush` releases those at the end).
        self._stream_ids: list[int] = []
        self._stream_text: list[str] = []
        self._stream_held = False
        # Fallback (window) state: all ids, the window start and the first undecoded id.
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def add(self, token_ids: Sequence[int]) -> str:
        """Append new token ids; the text that is now complete ("" when none is yet)."""
        if self.tokenizer is None or not token_ids:
            return ""
        if self._stream is not None:
            step, backend, specials = self._stream.step, self._backend, self._special
            fed = self._stream_ids
            text = ""
            for token_id in token_ids:
                token_id = int(token_id)
                fed.append(token_id)
                try:
                    chunk = step(backend, token_id)
                    self._stream_held = chunk is None
                except Exception:  # an id the tokenizer does not know (a padded vocab row)
                    chunk = None
                if specials:
                    special = specials.get(token_id)
                    if special is not None and self._last_special:
                        chunk = special
                    self._last_special = special is not None
                if chunk:
                    text += chunk
            if text:
                self._stream_text.append(text)
            return text
        parts = []
        for token_id in token_ids:  # one at a time: a partial character ends only the last
            self._ids.append(int(token_id))
            parts.append(self._advance(final=False))
        return "".join(parts)

    def add_final(self, token_ids: Sequence[int]) -> str:
        """`add` then `flush` for a whole finished sequence, on a fresh detokenizer: the
        window fallback decodes it in one call (the same text; its window exists only for
        streaming)."""
        if self._stream is not None or self._ids or self.tokenizer is None:
            return self.add(token_ids) + self.flush()
        self._ids = [int(t) for t in token_ids]
        self._prefix_offset = self._read_offset = len(self._ids)
        return _drop_partial(self._decode(self._ids))

    def flush(self) -> str:
        """At the finish: the text still held back, less an incomplete character at the very
        end (its bytes never print; vLLM drops them too)."""
        if self.tokenizer is None:
            return ""
        if self._stream is not None:
            if not self._stream_held:
                return ""
            # DecodeStream held the last token's text, whole characters included, waiting for
            # one to complete: decode the sequence once and release what it has not.
            try:
                full = _drop_partial(self._decode(self._stream_ids))
            except Exception:  # (an id the tokenizer does not know)
                return ""
            released = "".join(self._stream_text)
            self._stream_held = False
            if not full.startswith(released):
                return ""
            self._stream_text.append(full[len(released):])
            return full[len(released):]
        return _drop_partial(self._advance(final=True))

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        if hasattr(self.tokenizer, "all_special_ids"):  # a transformers tokenizer
            text: str = self.tokenizer.decode(
                ids, skip_special_tokens=self.skip_special_tokens,
                spaces_between_special_tokens=self.spaces_between_special_tokens)
        else:
            text = self.tokenizer.decode(ids)
        return text

    def _advance(self, *, final: bool) -> str:
        # The window starts where a previous decode ended on a complete character, so decoding
        # it alone gives the same text as decoding everything (UTF-8 resynchronises there).
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text):
            return ""
        if new_text.endswith(_REPLACEMENT) and not final:
            return ""  # the next token may complete the character
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return delta


def _drop_partial(text: str) -> str:
    """`text` less a trailing replacement character: the bytes of a character the sequence
    ended inside (the text never ends in half a character)."""
    return text[:-1] if text.endswith(_REPLACEMENT) else text


class StopStringMatcher:
    """Cut the text of one sequence at the first OpenAI ``stop`` string.

    Parameters
    ----------
    stop:
        The stop strings (empty strings are ignored).
    include_stop_str_in_output:
        Keep the matched stop string at the end of the text (vLLM's option; OpenAI drops it).

    Examples
    --------
    >>> m = StopStringMatcher(["END"])
    >>> m.add("abc E"), m.add("N"), m.add("Dxyz"), m.stopped
    ('abc ', '', '', True)
    """

    def __init__(self, stop: Sequence[str], *, include_stop_str_in_output: bool = False) -> None:
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self._max_len = max((len(s) for s in self.stop), default=0)
        self._text = ""
        self._emitted = 0
        # The released text as one string, grown by each release (read once per output).
        self._released = ""
        #: The stop string that matched, once one has.
        self.matched: str | None = None

    @property
    def stopped(self) -> bool:
        """True once a stop string matched (no more text will be returned)."""
        return self.matched is not None

    @property
    def text(self) -> str:
        """All text released so far."""
        return self._released

    def add(self, delta: str, *, match: bool = True) -> str:
        """Feed detokenized text; the part that can be released now.

        A stop string matches when it ends inside `delta` (it may begin in earlier text,
        which was held back for that reason). ``match=False`` (text produced before
        ``min_tokens``, as vLLM counts it) looks for no match in `delta`, but still holds back
        its tail that could begin one, so a stop string that ends after ``min_tokens`` is cut
        whole, never half released."""
        if self.matched is not None or not delta:
            return ""
        if not self.stop:  # everything is released at once
            self._released += delta
            self._text = self._released
            self._emitted = len(self._released)
            return delta
        old_len = len(self._text)
        self._text += delta
        hit = self._first_match(old_len) if match else None
        if hit is not None:
            index, stop = hit
            self.matched = stop
            end = index + len(stop) if self.include_stop_str_in_output else index
            return self._release(max(end, self._emitted))
        return self._release(len(self._text) - self._held_back())

    def flush(self) -> str:
        """At the end of the sequence: release what was held back (no stop string came)."""
        if self.stopped:
            return ""
        return self._release(len(self._text))

    def _first_match(self, old_len: int) -> tuple[int, str] | None:
        """The earliest occurrence of a stop string that ends past `old_len` characters (one
        that ended before was matched then, or lay before ``min_tokens``)."""
        best: tuple[int, str] | None = None
        for stop in self.stop:
            index = self._text.find(stop, max(0, old_len - len(stop) + 1))
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that begins some stop string."""
        longest = min(self._max_len - 1, len(self._text) - self._emitted)
        for k in range(longest, 0, -1):
            tail = self._text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0

    def _release(self, end: int) -> str:
        end = max(end, self._emitted)
        out = self._text[self._emitted : end]
        self._emitted = end
        self._released += out
        return out


class TextState:
    """The text of one generated sequence under its `SamplingParams`.

    Attributes
    ----------
    num_fed:
        Output tokens detokenized so far.
    """

    __slots__ = ("detok", "matcher", "min_tokens", "num_fed")

    def __init__(self, tokenizer: Any, params: SamplingParams) -> None:
        self.detok = IncrementalDetokenizer(
            tokenizer, skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens)
        self.matcher = StopStringMatcher(
            params.stop, include_stop_str_in_output=params.include_stop_str_in_output)
        self.min_tokens = params.min_tokens
        self.num_fed = 0

    @property
    def text(self) -> str:
        """The text released so far (cut at a matched stop string)."""
        return self.matcher.text

    @property
    def stop_string(self) -> str | None:
        """The stop string that matched, or None."""
        return self.matcher.matched


def advance_text(state: TextState, output_token_ids: Sequence[int], *,
                 finished: bool = False, offset: int = 0) -> str:
    """Feed `state` the ids of `output_token_ids` (all output ids of its sequence) it has not
    seen; the newly released text. ``finished``: the sequence ended, release what was held
    back. Once a stop string matched (``state.stop_string``) nothing more is released.
    `offset`: the output ids are ``output_token_ids[offset:]`` (a request's prompt-and-output
    list, not copied)."""
    matcher = state.matcher
    total = len(output_token_ids) - offset
    if matcher.matched is not None:
        state.num_fed = total
        return ""
    detok = state.detok
    fed = state.num_fed
    if not matcher.stop:
        # No stop string to look for: the new ids in one call (the same text as one at a
        # time), released at once.
        if finished and fed == 0:
            # Never seen before and already finished (generate's outputs): the whole text
            # at once.
            state.num_fed = total
            return matcher.add(detok.add_final(output_token_ids[offset:]), match=False)
        text = matcher.add(detok.add(output_token_ids[offset + fed:]), match=False) \
            if fed < total else ""
        state.num_fed = total
        if finished:
            text += matcher.add(detok.flush(), match=False)
            text += matcher.flush()
        return text
    parts = []
    for i in range(fed, total):
        # One token at a time: stop strings count only from min_tokens on (as in vLLM).
        j = offset + i
        parts.append(matcher.add(detok.add(output_token_ids[j : j + 1]),
                                 match=i + 1 > state.min_tokens))
        if matcher.stopped:
            break
    state.num_fed = total
    if finished and not matcher.stopped:
        parts.append(matcher.add(detok.flush(), match=total > state.min_tokens))
        parts.append(matcher.flush())
    return "".join(parts)
