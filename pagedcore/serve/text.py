"""Text for streams: incremental detokenization and stop strings matched across tokens.

`IncrementalDetokenizer` turns the token ids of one sequence, as they arrive, into text deltas
that never split a multi-byte character: over a Hugging Face fast tokenizer it uses
`tokenizers.decoders.DecodeStream` (constant work per token); over anything else with a
``decode`` method it decodes a short window of recent tokens and holds back a trailing
replacement character ("\\ufffd") until the next token completes it.

`StopStringMatcher` finds OpenAI ``stop`` strings in the detokenized text, even when a stop
string spans several tokens, and holds back the text that could still become one, so a client
never sees the start of a stop string that the server later cuts off.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["IncrementalDetokenizer", "StopStringMatcher", "backend_tokenizer"]

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

    Notes
    -----
    The deltas of `add` followed by `flush` concatenate to the text of the whole sequence.
    """

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._backend = backend_tokenizer(tokenizer)
        self._stream: Any = None
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        # Fallback (window) state: all ids, the window start and the first undecoded id.
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def add(self, token_ids: Sequence[int]) -> str:
        """Append new token ids; the text that is now complete ("" when none is yet)."""
        if self.tokenizer is None or not token_ids:
            return ""
        if self._stream is not None:
            parts = []
            for token_id in token_ids:
                chunk = self._stream.step(self._backend, int(token_id))
                if chunk:
                    parts.append(chunk)
            return "".join(parts)
        parts = []
        for token_id in token_ids:  # one at a time: a partial character ends only the last
            self._ids.append(int(token_id))
            parts.append(self._advance(final=False))
        return "".join(parts)

    def flush(self) -> str:
        """The text still held back (an incomplete character at the very end), at the finish."""
        if self.tokenizer is None or self._stream is not None:
            # DecodeStream holds only bytes no character can be made of: they never print.
            return ""
        return self._advance(final=True)

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        if self.skip_special_tokens and hasattr(self.tokenizer, "all_special_ids"):
            text: str = self.tokenizer.decode(ids, skip_special_tokens=True)
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
        #: The stop string that matched, once one has.
        self.matched: str | None = None

    @property
    def stopped(self) -> bool:
        """True once a stop string matched (no more text will be returned)."""
        return self.matched is not None

    @property
    def text(self) -> str:
        """All text released so far."""
        return self._text[: self._emitted]

    def add(self, delta: str) -> str:
        """Feed detokenized text; the part that can be released now."""
        if self.stopped or not delta:
            return ""
        if not self.stop:
            self._text += delta
            self._emitted = len(self._text)
            return delta
        start = max(0, len(self._text) - self._max_len + 1)
        self._text += delta
        hit = self._first_match(start)
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

    def _first_match(self, start: int) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self.stop:
            index = self._text.find(stop, start)
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
        return out
