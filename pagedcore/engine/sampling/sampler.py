"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from pagedcore.engine.sampling.sampling_params import SamplingParams

__all__ = ["Sampler", "apply_top_k_top_p_min_p"]


def apply_top_k_top_p_min_p(
    logits: torch.Tensor,
    *,
    top_k: Sequence[int | None],
    top_p: Sequence[float],
    min_p: Sequence[float],
) -> torch.Tensor:
    """Mask filtered-out tokens with ``-inf``.

    Parameters
    ----------
    logits:
        ``[R, V]`` float32, already divided by the temperature.
    top_k, top_p, min_p:
        One value per row (None / 1.0 / 0.0 disable a filter).

    Returns
    -------
    torch.Tensor
        ``[R, V]`` float32, a new tensor.
    """
    import torch

    logits = logits.clone()
    vocab = logits.shape[1]
    if any(k is not None and k < vocab for k in top_k):
        ks = torch.tensor([vocab if k is None else min(k, vocab) for k in top_k],
                          device=logits.device)
        sorted_desc = logits.sort(dim=-1, descending=True).values
        kth = sorted_desc.gather(1, (ks - 1).unsqueeze(1))
        logits.masked_fill_(logits < kth, float("-inf"))
    if any(p < 1.0 for p in top_p):
        ps = torch.tensor(list(top_p), device=logits.device, dtype=torch.float32)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Mass strictly before each token; a token is kept while that mass is below p, so the
        # most likely token always survives.
        before = probs.cumsum(dim=-1) - probs
        drop_sorted = before >= ps.unsqueeze(1)
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        logits.masked_fill_(drop, float("-inf"))
    if any(m > 0.0 for m in min_p):
        ms = torch.tensor(list(min_p), device=logits.device, dtype=torch.float32)
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * ms.unsqueeze(1)
        logits.masked_fill_(probs < threshold, float("-inf"))
    return logits


class Sampler:
    """Picks one token per row of logits under each row's `SamplingParams`.

    Parameters
    ----------
    seed:
        Seeds the generator shared by rows without their own `seed`.
    """

    def __init__(self, *, seed: int = 0) -> None:
        self._seed = seed
        self._shared: dict[str, torch.Generator] = {}
        self._own: dict[str, torch.Generator] = {}
        #: Rows of the last `sample` call whose own setup raised (request id -> reason); their
        #: tokens are meaningless and the caller fails those requests alone.
        self.row_errors: dict[str, str] = {}

    def _generator(
        self, device: torch.device, request_id: str, seed: int | None
    ) -> torch.Generator:
        import torch

        if seed is None:
            key = str(device)
            gen = self._shared.get(key)
            if gen is None:
                gen = torch.Generator(device=device)
                gen.manual_seed(self._seed)
                self._shared[key] = gen
            return gen
        gen = self._own.get(request_id)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(seed)
            self._own[request_id] = gen
        return gen

    def forget(self, request_id: str) -> None:
        """Drop a finished request's generator."""
        self._own.pop(request_id, None)

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        request_ids: Sequence[str],
    ) -> tuple[list[int], list[dict[int, float] | None]]:
        """Sample one token per row.

        Parameters
        ----------
        logits:
            ``[R, V]`` raw model logits (any float dtype); row ``i`` belongs to
            ``request_ids[i]`` sampled under ``params[i]``.

        Returns
        -------
        tuple
            The token ids, and per row ``{token: logprob}`` (top ``logprobs`` tokens plus the
            sampled one, log-softmax of the raw logits) or None when not requested. A row
            whose own setup raised (its seeded generator) is listed in `row_errors` instead
            of failing the call.
        """
        import torch

        row_errors: dict[str, str] = {}
        self.row_errors = row_errors
        logits = logits.float()
        num_rows = logits.shape[0]
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i in range(num_rows) if not params[i].greedy]
        if random_rows:
            idx = torch.tensor(random_rows, device=logits.device)
            sub = logits.index_select(0, idx)
            temps = torch.tensor([params[i].temperature for i in random_rows],
                                 device=logits.device, dtype=torch.float32)
            sub = sub / temps.unsqueeze(1)
            sub = apply_top_k_top_p_min_p(
                sub,
                top_k=[params[i].effective_top_k for i in random_rows],
                top_p=[params[i].top_p for i in random_rows],
                min_p=[params[i].min_p for i in random_rows],
            )
            probs = sub.softmax(dim=-1)
            for row, i in enumerate(random_rows):
                try:
                    gen = self._generator(logits.device, request_ids[i], params[i].seed)
                except Exception as exc:  # a bad seed fails its own request, not the step
                    row_errors[request_ids[i]] = (
                        f"sampler setup failed: {type(exc).__name__}: {exc}")
                    continue
                # Exponential race: argmax(p / E) with E ~ Exp(1) samples from p.
                noise = torch.empty_like(probs[row]).exponential_(generator=gen)
                tokens[i] = (probs[row] / noise).argmax()
        token_list = [int(t) for t in tokens.tolist()]
        logprob_rows: list[dict[int, float] | None] = [None] * num_rows
        wanted = [i for i in range(num_rows) if params[i].logprobs is not None]
        if wanted:
            logprobs = logits.index_select(0, torch.tensor(wanted, device=logits.device))
            logprobs = logprobs.log_softmax(dim=-1)
            for row, i in enumerate(wanted):
                count = params[i].logprobs or 0
                entry: dict[int, float] = {}
                if count:
                    top = logprobs[row].topk(min(count, logprobs.shape[1]))
                    entry = dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
                entry[token_list[i]] = float(logprobs[row, token_list[i]])
                logprob_rows[i] = entry
        return token_list, logprob_rows
