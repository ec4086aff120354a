"""Logits processors applied to a whole batch on the device before sampling.

In vLLM's order: `allowed_token_ids`, `bad_words`, `min_tokens` (EOS and stop tokens masked),
`logit_bias`, then the repetition, frequency and presence penalties. Each works on the rows
that use it with one tensor operation over the batch (a scatter into a ``[R, V]`` count or mask
tensor); no Python loop runs over the vocabulary. Python loops run over requests only to
gather their token ids (and over a request's bad words, which are few).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from itertools import chain
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from pagedcore.engine.sampling.sampling_params import SamplingParams

__all__ = ["SampledSequence", "apply_logits_processors", "apply_penalties"]


class SampledSequence(Protocol):
    """What the processors read of one row's sequence (a scheduling `Request`)."""

    @property
    def all_token_ids(self) -> Sequence[int]: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def eos_token_ids(self) -> Collection[int]: ...

    @property
    def bad_words_token_ids(self) -> Sequence[Sequence[int]]: ...


def _rows_tensor(rows: Sequence[int], device: torch.device) -> torch.Tensor:
    import torch

    return torch.tensor(list(rows), dtype=torch.long, device=device)


def _scatter_ids(
    id_lists: Sequence[Sequence[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) pairs of every id of every list, as two ``[N]`` int64 tensors."""
    import torch

    lengths = torch.tensor([len(ids) for ids in id_lists], dtype=torch.long)
    row = torch.repeat_interleave(torch.arange(len(id_lists)), lengths)
    col = torch.tensor(list(chain.from_iterable(id_lists)), dtype=torch.long)
    return row.to(device), col.to(device)


def apply_penalties(
    logits: torch.Tensor,
    *,
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    presence: Sequence[float],
    frequency: Sequence[float],
    repetition: Sequence[float],
) -> torch.Tensor:
    """Repetition, frequency and presence penalties for every row at once (in place).

    Parameters
    ----------
    logits:
        ``[R, V]`` float32.
    prompt_ids, output_ids:
        Per row, the prompt's and the output's token ids.
    presence, frequency, repetition:
        Per row: subtract ``presence * (count > 0)`` and ``frequency * count`` (output tokens),
        and divide positive / multiply negative logits of tokens seen in the prompt or the
        output by ``repetition``.

    Returns
    -------
    torch.Tensor
        `logits`, changed.
    """
    import torch

    num_rows, vocab = logits.shape
    device = logits.device
    counts = torch.zeros((num_rows, vocab), dtype=torch.float32, device=device)
    row, col = _scatter_ids(output_ids, device)
    counts.index_put_((row, col), torch.ones_like(col, dtype=torch.float32), accumulate=True)
    seen = counts > 0
    rep = torch.tensor(list(repetition), dtype=torch.float32, device=device).unsqueeze(1)
    if any(r != 1.0 for r in repetition):
        in_prompt = torch.zeros_like(seen)
        prow, pcol = _scatter_ids(prompt_ids, device)
        in_prompt[prow, pcol] = True
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(in_prompt | seen, penalised, logits)
    freq = torch.tensor(list(frequency), dtype=torch.float32, device=device).unsqueeze(1)
    pres = torch.tensor(list(presence), dtype=torch.float32, device=device).unsqueeze(1)
    return logits - freq * counts - pres * seen.float()


def _bad_word_bans(
    sequences: Sequence[SampledSequence], rows: Sequence[int]
) -> tuple[list[int], list[int]]:
    ban_rows: list[int] = []
    ban_ids: list[int] = []
    for row in rows:
        seq = sequences[row]
        output = seq.all_token_ids[seq.num_prompt_tokens :]
        for word in seq.bad_words_token_ids:
            prefix = len(word) - 1
            if prefix == 0 or (prefix <= len(output)
                               and list(output[len(output) - prefix :]) == list(word[:-1])):
                ban_rows.append(row)
                ban_ids.append(word[-1])
    return ban_rows, ban_ids


def apply_logits_processors(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    sequences: Sequence[SampledSequence],
) -> torch.Tensor:
    """Every processor the rows' `params` ask for; rows that ask for none are left as they are.

    Parameters
    ----------
    logits:
        ``[R, V]`` float32 (row ``i`` of ``sequences[i]`` under ``params[i]``).

    Returns
    -------
    torch.Tensor
        ``[R, V]`` float32, a new tensor.
    """
    import torch

    device = logits.device
    vocab = logits.shape[1]
    logits = logits.clone()
    neg_inf = float("-inf")
    allowed = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    if allowed:
        mask = torch.ones((len(allowed), vocab), dtype=torch.bool, device=device)
        row, col = _scatter_ids(
            [[t for t in params[i].allowed_token_ids or () if t < vocab] for i in allowed],
            device)
        mask[row, col] = False
        idx = _rows_tensor(allowed, device)
        logits[idx] = logits[idx].masked_fill(mask, neg_inf)
    ban_rows, ban_ids = _bad_word_bans(
        sequences, [i for i, p in enumerate(params) if p.bad_words])
    # min_tokens: no EOS / stop token before the request has that many tokens.
    for i, p in enumerate(params):
        seq = sequences[i]
        if p.min_tokens and len(seq.all_token_ids) - seq.num_prompt_tokens < p.min_tokens:
            stops = set(p.stop_token_ids)
            if not p.ignore_eos:
                stops |= set(seq.eos_token_ids)
            ban_rows += [i] * len(stops)
            ban_ids += sorted(stops)
    keep = [(r, t) for r, t in zip(ban_rows, ban_ids, strict=True) if 0 <= t < vocab]
    if keep:
        logits[_rows_tensor([r for r, _ in keep], device),
               _rows_tensor([t for _, t in keep], device)] = neg_inf
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    if biased:
        pairs = [(i, t, b) for i in biased for t, b in (params[i].logit_bias or {}).items()
                 if t < vocab]
        if pairs:
            values = torch.tensor([b for _, _, b in pairs], dtype=torch.float32, device=device)
            logits.index_put_((_rows_tensor([i for i, _, _ in pairs], device),
                               _rows_tensor([t for _, t, _ in pairs], device)),
                              values, accumulate=True)
    penalised = [i for i, p in enumerate(params) if p.has_penalties]
    if penalised:
        idx = _rows_tensor(penalised, device)
        seqs = [sequences[i] for i in penalised]
        logits[idx] = apply_penalties(
            logits[idx],
            prompt_ids=[s.all_token_ids[: s.num_prompt_tokens] for s in seqs],
            output_ids=[s.all_token_ids[s.num_prompt_tokens :] for s in seqs],
            presence=[params[i].presence_penalty for i in penalised],
            frequency=[params[i].frequency_penalty for i in penalised],
            repetition=[params[i].repetition_penalty for i in penalised],
        )
    return logits
