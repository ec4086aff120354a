"""Incremental detokenization and stop strings, on a BPE tokenizer trained in the test."""

from __future__ import annotations

from typing import Any

import pytest
from tokenizer_helpers import CORPUS, train_tokenizer

from pagedcore.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from pagedcore.engine.models.loading import ByteTokenizer

TEXTS = ["Le café: crème brûlée, déjà vu.", "日本の首都は東京です。", "mixed é日本x é",
         "plain ascii"]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return train_tokenizer()


class _DecodeOnly:
    """A tokenizer without a `tokenizers` backend: only decode (the fallback path)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def decode(self, ids: list[int]) -> str:
        text: str = self.inner.decode(ids)
        return text


def _stream(detok: IncrementalDetokenizer, ids: list[int], step: int) -> list[str]:
    deltas = [detok.add(ids[i : i + step]) for i in range(0, len(ids), step)]
    return [*deltas, detok.flush()]


@pytest.mark.parametrize("wrap", [False, True], ids=["decode-stream", "window-fallback"])
@pytest.mark.parametrize("step", [1, 3])
def test_bpe_deltas_concatenate_and_never_split_a_character(tokenizer: Any, wrap: bool,
                                                            step: int) -> None:
    eos = tokenizer.eos_token_id
    for text in TEXTS:
        ids = [*tokenizer.encode(text), eos]
        # Byte-level BPE learned merges, yet some multi-byte characters still span tokens.
        tok = _DecodeOnly(tokenizer) if wrap else tokenizer
        deltas = _stream(IncrementalDetokenizer(tok), ids, step)
        assert "\ufffd" not in "".join(deltas)
        expected = tokenizer.decode(ids, skip_special_tokens=not wrap)
        assert "".join(deltas) == expected
        # A finished sequence seen for the first time: one call, the same text.
        assert IncrementalDetokenizer(tok).add_final(ids) == expected


@pytest.mark.parametrize("wrap", [False, True], ids=["decode-stream", "window-fallback"])
def test_a_sequence_ending_inside_a_character_keeps_its_whole_characters(
        tokenizer: Any, wrap: bool) -> None:
    """Tokens whose text is whole characters then the first bytes of another (sampled, they
    follow no merge): DecodeStream holds all of such a token's text until a character
    completes; at the finish that text is released, less only the unfinished character."""
    partial = [i for i in range(len(tokenizer))
               if (t := tokenizer.decode([i])).endswith("\ufffd") and len(t.rstrip("\ufffd")) > 0]
    assert partial, "the test needs tokens that end inside a character"
    tok = _DecodeOnly(tokenizer) if wrap else tokenizer
    for token in partial[:5]:
        plain = tokenizer.encode("r", add_special_tokens=False)[0]
        for ids in ([token], [token, token, token], [plain, token]):
            full = tokenizer.decode(ids)
            expected = full[:-1]  # (decode's own text, less the one unfinished character)
            for step in (1, 2):
                assert "".join(_stream(IncrementalDetokenizer(tok), ids, step)) == expected
            assert IncrementalDetokenizer(tok).add_final(ids) == expected


def test_window_fallback_never_decodes_the_whole_output(tokenizer: Any) -> None:
    """Incremental: each step decodes a window of a few tokens, not everything so far."""
    lengths: list[int] = []

    class Counting(_DecodeOnly):
        def decode(self, ids: list[int]) -> str:
            lengths.append(len(ids))
            return super().decode(ids)

    ids = tokenizer.encode(" ".join(CORPUS[:6]), add_special_tokens=False)
    detok = IncrementalDetokenizer(Counting(tokenizer))
    text = "".join(_stream(detok, ids, 1))
    assert text == tokenizer.decode(ids) and len(ids) > 60
    assert max(lengths) <= 8, max(lengths)


def test_bpe_splits_some_character_across_tokens(tokenizer: Any) -> None:
    """The case the detokenizer exists for really occurs with this tokenizer."""
    split = [t for text in TEXTS for t in tokenizer.encode(text)
             if "\ufffd" in tokenizer.decode([t])]
    assert split


def test_byte_tokenizer_holds_partial_characters() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("é日本!", add_bos=False)  # 2 + 3 + 3 + 1 bytes
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add([t]) for t in ids]
    assert deltas == ["", "é", "", "", "日", "", "", "本", "!"]
    assert detok.flush() == ""
    # A character the sequence ends inside never prints (its bytes are dropped at the finish).
    detok = IncrementalDetokenizer(tok)
    assert detok.add(ids[:3]) == "é"
    assert detok.flush() == ""


def test_no_tokenizer_gives_no_text() -> None:
    detok = IncrementalDetokenizer(None)
    assert detok.add([1, 2, 3]) == "" and detok.flush() == ""


def _feed(matcher: StopStringMatcher, parts: list[str]) -> list[str]:
    out = []
    for p in parts:
        out.append(matcher.add(p))
        if matcher.stopped:
            break
    else:
        out.append(matcher.flush())
    return out


def test_stop_string_across_deltas_is_held_back_and_cut() -> None:
    m = StopStringMatcher(["STOP"])
    assert _feed(m, ["abc S", "T", "O", "Pxyz"]) == ["abc ", "", "", ""]
    assert m.stopped and m.matched == "STOP" and m.text == "abc "


def test_false_start_is_released() -> None:
    m = StopStringMatcher(["STOP"])
    assert _feed(m, ["ab ST", "x", "y"]) == ["ab ", "STx", "y", ""]
    assert not m.stopped and m.text == "ab STxy"


def test_earliest_of_several_stops_and_include_option() -> None:
    m = StopStringMatcher(["world", "lo w"], include_stop_str_in_output=True)
    assert "".join(_feed(m, ["hel", "lo wor", "ld"])) == "hello w"
    assert m.matched == "lo w"


def test_text_held_at_the_end_is_flushed() -> None:
    m = StopStringMatcher(["</answer>"])
    assert _feed(m, ["42 </ans"]) == ["42 ", "</ans"]


def test_stop_strings_over_real_tokens(tokenizer: Any) -> None:
    """Detokenizer + matcher on a real token stream: the stop string spans several tokens and
    the released text is exactly the prefix before it."""
    text = "Le café: crème brûlée, déjà vu."
    ids = tokenizer.encode(text)
    detok, m = IncrementalDetokenizer(tokenizer), StopStringMatcher(["brûlée"])
    released = ""
    for t in ids:
        released += m.add(detok.add([t]))
        assert "br" not in released  # never a piece of the stop string
        if m.stopped:
            break
    assert m.stopped and released == "Le café: crème "


def test_spaces_between_special_tokens(tokenizer: Any) -> None:
    """Off: two adjacent special tokens are written bare, as vLLM's fast detokenizer does."""
    from tokenizers import decoders

    tok = train_tokenizer()
    tok.backend_tokenizer.decoder = decoders.WordPiece(cleanup=False)  # joins tokens by " "
    ids = [tok.convert_tokens_to_ids(t) for t in ("<|user|>", "<|end|>", "<|assistant|>")]
    spaced = IncrementalDetokenizer(tok, skip_special_tokens=False)
    bare = IncrementalDetokenizer(tok, skip_special_tokens=False,
                                  spaces_between_special_tokens=False)
    assert bare.add(ids) == "<|user|><|end|><|assistant|>"
    assert spaced.add(ids) == tok.decode(ids) == "<|user|> <|end|> <|assistant|>"
    assert IncrementalDetokenizer(tok).add(ids) == ""  # skipped altogether


# ---- stop strings and min_tokens (vLLM: a stop string counts once the output has more than
# min_tokens tokens, and it must end in the new text) ------------------------------------------


def _feed_tokens(pieces: list[str], min_tokens: int, stop: list[str],
          include: bool = False) -> tuple[str, str | None]:
    m = StopStringMatcher(stop, include_stop_str_in_output=include)
    out = []
    for i, piece in enumerate(pieces):
        out.append(m.add(piece, match=i + 1 > min_tokens))
        assert m.text == "".join(out)
        if m.stopped:
            break
    if not m.stopped:
        out.append(m.flush())
    return "".join(out), m.matched


def test_stop_string_ending_after_min_tokens_is_cut_whole() -> None:
    # It begins in a token before min_tokens: that part was held back, not released.
    assert _feed_tokens(['"', "'", "g"], 2, ["'g"]) == ('"', "'g")


def test_stop_string_entirely_before_min_tokens_does_not_stop() -> None:
    assert _feed_tokens(["\n", " that", "em"], 1, ["\n", "ooo"]) == ("\n thatem", None)
    # ... but its next occurrence, after min_tokens, does.
    assert _feed_tokens(["a\n", "b", "c\n", "d"], 1, ["\n"]) == ("a\nbc", "\n")


def _oracle(pieces: list[str], min_tokens: int, stop: list[str],
            include: bool) -> tuple[str, str | None]:
    """After each token past min_tokens: the earliest stop occurrence ending in its text
    (at one position, the first of `stop`)."""
    text = ""
    for i, piece in enumerate(pieces):
        old = len(text)
        text += piece
        if i + 1 <= min_tokens:
            continue
        hits = [(j, k) for k, s in enumerate(stop)  # (ties: the first in the list)
                for j in range(len(text) - len(s) + 1)
                if text.startswith(s, j) and j + len(s) > old]
        if hits:
            j, k = min(hits)
            return text[: j + len(stop[k]) if include else j], stop[k]
    return text, None


def test_stop_strings_with_min_tokens_match_an_oracle() -> None:
    import random

    rng = random.Random(7)
    for _ in range(3000):
        text = "".join(rng.choice("ab\n") for _ in range(rng.randint(1, 14)))
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        stop = [("".join(rng.choice("ab\n") for _ in range(rng.randint(1, 3))))
                for _ in range(rng.randint(1, 3))]
        min_tokens, include = rng.randint(0, 4), rng.random() < 0.3
        assert _feed_tokens(pieces, min_tokens, stop, include) == _oracle(pieces, min_tokens, stop,
                                                                    include), (pieces, stop,
                                                                               min_tokens)
