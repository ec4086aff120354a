"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

Before any of these, the logits processors of `pagedcore.engine.sampling.logits_processors`
(penalties, logit bias, bad words, allowed tokens, min_tokens) run on the rows that ask for
them. Log-probabilities are those of the raw model logits (vLLM's default).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from pagedcore.engine.sampling.device_sample import SampledTokens
    from pagedcore.engine.sampling.logits_processors import SampledSequence
    from pagedcore.engine.sampling.sampling_params import SamplingParams

from pagedcore.engine.sampling.device_sample import TokenLogprobs

__all__ = ["Sampler", "TokenLogprobs", "apply_top_k_top_p_min_p"]


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
        ``[R, V]`` float32: a new tensor when a filter applies, else `logits` itself
        (never written into).
    """
    import torch

    vocab = logits.shape[1]
    use_k = any(k is not None and k < vocab for k in top_k)
    use_p = any(p < 1.0 for p in top_p)
    use_min_p = any(m > 0.0 for m in min_p)
    if not (use_k or use_p or use_min_p):
        return logits  # (a copy of a [256, 152K] batch for nothing)
    logits = logits.clone()
    if use_k:
        ks = _to_device([vocab if k is None else min(k, vocab) for k in top_k], torch.int64,
                        logits.device)
        sorted_desc = logits.sort(dim=-1, descending=True).values
        kth = sorted_desc.gather(1, (ks - 1).unsqueeze(1))
        logits.masked_fill_(logits < kth, float("-inf"))
    if use_p:
        ps = _to_device(list(top_p), torch.float32, logits.device)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Mass strictly before each token; a token is kept while that mass is below p, so the
        # most likely token always survives.
        before = probs.cumsum(dim=-1) - probs
        drop_sorted = before >= ps.unsqueeze(1)
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        logits.masked_fill_(drop, float("-inf"))
    if use_min_p:
        ms = _to_device(list(min_p), torch.float32, logits.device)
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
        *,
        sequences: Sequence[SampledSequence] | None = None,
    ) -> tuple[list[int], list[dict[int, float] | None]]:
        """Sample one token per row (`sample_device`, then its tokens on the host).

        Parameters
        ----------
        logits:
            ``[R, V]`` raw model logits (any float dtype); row ``i`` belongs to
            ``request_ids[i]`` sampled under ``params[i]``.
        sequences:
            Row ``i``'s sequence (its token ids so far), needed when a row's params process the
            logits (penalties, bad words, min_tokens); None: no row does.

        Returns
        -------
        tuple
            The token ids, and per row a `TokenLogprobs` (top ``logprobs`` tokens plus the
            sampled one, log-softmax of the raw logits, and the sampled token's rank) or None
            when not requested. A row
            whose own setup raised (its seeded generator) is listed in `row_errors` instead
            of failing the call.
        """
        return self.sample_device(logits, params, request_ids, sequences=sequences).to_host()

    def sample_device(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        request_ids: Sequence[str],
        *,
        sequences: Sequence[SampledSequence] | None = None,
    ) -> SampledTokens:
        """Sample one token per row, leaving the result on the logits' device.

        Nothing here waits for the device: per-row settings reach it from pinned memory
        (`_to_device`), the tokens and log-probabilities stay device tensors
        (`SampledTokens.to_host` brings them over). Parameters as for `sample`; rows whose
        own setup raised are in ``row_errors`` (of the result and of this sampler).
        """
        import torch

        from pagedcore.engine.sampling.device_sample import SampledTokens

        row_errors: dict[str, str] = {}
        self.row_errors = row_errors
        device = logits.device
        num_rows = logits.shape[0]
        raw = logits
        # One pass over the rows' params (a property call per row and question costs more
        # host time at 256 rows than the rest of this method).
        processes = False
        random_rows: list[int] = []
        wanted: list[int] = []
        for i, p in enumerate(params):
            if p._processes_logits:
                processes = True
            if p.temperature != 0.0:  # not `greedy`
                random_rows.append(i)
            if p.logprobs is not None:
                wanted.append(i)
        if processes:
            if sequences is None:
                raise ValueError("these sampling params process the logits (penalties, bad "
                                 "words, min_tokens): pass the rows' sequences")
            from pagedcore.engine.sampling.logits_processors import apply_logits_processors

            logits = apply_logits_processors(logits.float(), params, sequences)
        # Greedy rows: the argmax of the logits as they are (a bf16 -> float32 copy of a
        # [256, 152K] batch costs more than the argmax; the order of the values is the same).
        tokens = logits.argmax(dim=-1)
        if random_rows or wanted:
            processed = logits is not raw
            logits = logits.float()
            # (Nothing below writes into either: without processors they may be one tensor.)
            raw = raw.float() if processed else logits
        if random_rows:
            idx = _to_device(random_rows, torch.int64, device)
            sub = logits if len(random_rows) == num_rows else logits.index_select(0, idx)
            temps = _to_device([params[i].temperature for i in random_rows], torch.float32,
                               device)
            sub = sub / temps.unsqueeze(1)
            sub = apply_top_k_top_p_min_p(
                sub,
                top_k=[params[i].effective_top_k for i in random_rows],
                top_p=[params[i].top_p for i in random_rows],
                min_p=[params[i].min_p for i in random_rows],
            )
            probs = sub.softmax(dim=-1)
            # Exponential race: argmax(p / E) with E ~ Exp(1) samples from p. Rows without a
            # seed share the sampler's generator: one draw for all of them (a launch or four
            # per row cost ~8 ms of host time at 256 sampled rows on the H200's host).
            shared = [row for row, i in enumerate(random_rows) if params[i].seed is None]
            if shared:
                gen = self._generator(device, "", None)
                rows_p, dest = probs, idx  # (the common case: no random row has a seed)
                if len(shared) < len(random_rows):
                    pick = _to_device(shared, torch.int64, device)
                    rows_p, dest = probs.index_select(0, pick), idx.index_select(0, pick)
                noise = torch.empty_like(rows_p).exponential_(generator=gen)
                tokens.index_copy_(0, dest, (rows_p / noise).argmax(dim=-1))
            for row, i in enumerate(random_rows):
                if params[i].seed is None:
                    continue
                # A seeded request draws from its own generator, whatever its neighbours.
                try:
                    gen = self._generator(device, request_ids[i], params[i].seed)
                except Exception as exc:  # a bad seed fails its own request, not the step
                    row_errors[request_ids[i]] = (
                        f"sampler setup failed: {type(exc).__name__}: {exc}")
                    continue
                noise = torch.empty_like(probs[row]).exponential_(generator=gen)
                tokens[i] = (probs[row] / noise).argmax()
        if not wanted:
            return SampledTokens(tokens, row_errors=row_errors)
        counts = [min(params[i].logprobs or 0, logits.shape[1]) for i in wanted]
        rows_t = _to_device(wanted, torch.int64, device)
        # Log-probabilities of the raw model logits (vLLM's default), whatever processed them.
        logprobs = raw.index_select(0, rows_t).log_softmax(dim=-1)
        sampled_lp = logprobs.gather(1, tokens.index_select(0, rows_t).unsqueeze(1)).squeeze(1)
        # The sampled token's rank: 1 + the tokens strictly more likely.
        ranks = (logprobs > sampled_lp.unsqueeze(1)).sum(dim=1) + 1
        top_ids = top_values = None
        if max(counts):
            top = logprobs.topk(max(counts), dim=-1)
            top_ids, top_values = top.indices, top.values
        return SampledTokens(
            tokens, logprob_rows=wanted, logprob_counts=counts, top_ids=top_ids,
            top_values=top_values, sampled_logprobs=sampled_lp, sampled_ranks=ranks,
            row_errors=row_errors,
        )


def _to_device(values: Sequence[float] | Sequence[int], dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    """A small host list on `device` without a host sync (on CUDA: staged in pinned memory
    and copied asynchronously; a plain ``torch.tensor(..., device=cuda)`` waits for the
    stream, which would stall a step launched while the previous one runs)."""
    import torch

    if device.type != "cuda":
        return torch.tensor(list(values), dtype=dtype, device=device)
    host = torch.tensor(list(values), dtype=dtype).pin_memory()
    return host.to(device, non_blocking=True)
