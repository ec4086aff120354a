"""Prompt log-probabilities: the log-softmax of prompt positions' logits, scored on the prompt.

The model runner computes ``lm_head`` over the rows `pagedcore.engine.runner.prompt_rows`
picks (after the sampled rows); `record_prompt_logprobs` turns them into one `TokenLogprobs`
per prompt token (the top ``prompt_logprobs`` tokens plus the prompt token itself, with its
rank) and appends them to each request's ``prompt_logprobs``, exactly as `Sampler` does for
generated tokens (log-softmax of the raw model logits, vLLM's default).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedcore.engine.sampling.device_sample import TokenLogprobs

if TYPE_CHECKING:
    import torch

    from pagedcore.engine.runner.prompt_rows import PromptRows

__all__ = ["record_prompt_logprobs", "token_logprobs"]

#: Rows log-softmaxed at once (a 256 x 152K float32 block is 156 MB).
_ROWS_PER_BLOCK = 256


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, counts: list[int]
) -> list[TokenLogprobs]:
    """Per row, the top ``counts[i]`` tokens and the target token, with the target's rank.

    Parameters
    ----------
    logits:
        ``[Q, V]`` raw model logits (any float dtype; scored in float32).
    targets:
        ``[Q]`` int64 on the logits' device: the token each row scores.
    counts:
        ``Q`` ints >= 0: how many top tokens each row returns.

    Returns
    -------
    list of TokenLogprobs
        ``{token: logprob}`` (at most ``counts[i] + 1`` entries) with ``rank``: 1 + the tokens
        strictly more likely than the target.
    """
    k = min(max(counts, default=0), int(logits.shape[1]))
    target_values: list[float] = []
    ranks: list[int] = []
    top_ids: list[list[int]] = []
    top_values: list[list[float]] = []
    # In blocks of rows: a long prompt chunk's float32 log-softmax is never whole in memory.
    for lo in range(0, int(logits.shape[0]), _ROWS_PER_BLOCK):
        logprobs = logits[lo : lo + _ROWS_PER_BLOCK].float().log_softmax(dim=-1)
        target_lp = logprobs.gather(
            1, targets[lo : lo + _ROWS_PER_BLOCK].unsqueeze(1)).squeeze(1)
        ranks += ((logprobs > target_lp.unsqueeze(1)).sum(dim=1) + 1).tolist()
        target_values += target_lp.tolist()
        if k:
            top = logprobs.topk(k, dim=-1)
            top_ids += top.indices.tolist()
            top_values += top.values.tolist()
    out = []
    for i, (target, value) in enumerate(zip(targets.tolist(), target_values, strict=True)):
        n = counts[i]
        entry = dict(zip(top_ids[i][:n], top_values[i][:n], strict=True)) if n else {}
        entry[target] = float(value)
        out.append(TokenLogprobs(entry, rank=int(ranks[i])))
    return out


def record_prompt_logprobs(rows: PromptRows, logits: torch.Tensor) -> None:
    """Append each request's new prompt entries (`rows`' order) to its ``prompt_logprobs``.

    Parameters
    ----------
    logits:
        ``[Q, V]``: the logits of ``rows.indices``, in that order.
    """
    import torch

    counts: list[int] = []
    for request, count in zip(rows.requests, rows.counts, strict=True):
        counts.extend([int(request.params.prompt_logprobs or 0)] * count)
    targets = torch.tensor(rows.targets, dtype=torch.int64, device=logits.device)
    entries = token_logprobs(logits, targets, counts)
    offset = 0
    for request, first, count in zip(rows.requests, rows.first_positions, rows.counts,
                                     strict=True):
        have = request.prompt_logprobs
        assert have is not None and len(have) == first, (len(have or ()), first)
        have.extend(entries[offset : offset + count])
        offset += count
