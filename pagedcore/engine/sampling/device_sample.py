"""A step's sampled tokens while they are still on the device (`SampledTokens`).

With overlap scheduling the sampled ids of step N feed step N+1's input ids on the device
(`pagedcore.engine.runner.overlap.resolve_placeholders`), and reach the host one step behind:
`SampledTokens.start_copy` queues their copy into pinned memory behind the step's kernels and
records a CUDA event; `to_host` waits for that event only (never for later steps) and turns
the copies into Python lists. Without overlap `Sampler.sample` calls both at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["SampledTokens"]


class SampledTokens:
    """One step's sampled token ids and log-probabilities, device-resident until `to_host`.

    Parameters
    ----------
    tokens:
        ``[R]`` int64 on the logits' device: the token of each row.
    logprob_rows:
        The rows that asked for log-probabilities, ascending.
    logprob_counts:
        Per such row, how many top tokens it asked for (0: the sampled one only).
    top_ids, top_values:
        ``[W, K]`` int64 / float32 (``W = len(logprob_rows)``, ``K = max(logprob_counts)``):
        each wanted row's top-``K`` tokens by log-softmax (None when ``W == 0`` or ``K == 0``).
    sampled_logprobs:
        ``[W]`` float32: each wanted row's log-probability of its sampled token (None: W == 0).
    row_errors:
        Rows whose own sampling setup raised (request id -> reason); their tokens are garbage.
    """

    __slots__ = (
        "_event", "_host", "logprob_counts", "logprob_rows", "row_errors", "sampled_logprobs",
        "tokens", "top_ids", "top_values",
    )

    def __init__(
        self,
        tokens: torch.Tensor,
        *,
        logprob_rows: Sequence[int] = (),
        logprob_counts: Sequence[int] = (),
        top_ids: torch.Tensor | None = None,
        top_values: torch.Tensor | None = None,
        sampled_logprobs: torch.Tensor | None = None,
        row_errors: dict[str, str] | None = None,
    ) -> None:
        self.tokens = tokens
        self.logprob_rows = list(logprob_rows)
        self.logprob_counts = list(logprob_counts)
        self.top_ids = top_ids
        self.top_values = top_values
        self.sampled_logprobs = sampled_logprobs
        self.row_errors: dict[str, str] = {} if row_errors is None else row_errors
        self._event: Any = None
        self._host: list[torch.Tensor | None] | None = None

    def _device_tensors(self) -> list[torch.Tensor | None]:
        return [self.tokens, self.top_ids, self.top_values, self.sampled_logprobs]

    def start_copy(self) -> None:
        """Queue the copy of every tensor to pinned host memory behind the step's kernels and
        record an event (on the CPU: nothing to do). Idempotent."""
        if self._host is not None:
            return
        import torch

        tensors = self._device_tensors()
        if self.tokens.device.type != "cuda":
            self._host = tensors
            return
        host: list[torch.Tensor | None] = []
        for t in tensors:
            if t is None:
                host.append(None)
                continue
            pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            pinned.copy_(t, non_blocking=True)
            host.append(pinned)
        self._host = host
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.tokens.device))
        self._event = event

    def ready(self) -> bool:
        """True when `to_host` would not wait (the copy landed, or nothing is queued)."""
        return self._event is None or bool(self._event.query())

    def to_host(self) -> tuple[list[int], list[dict[int, float] | None]]:
        """Wait for this step's copy (only) and return the token ids, and per row
        ``{token: logprob}`` (the top tokens it asked for plus the sampled one) or None."""
        self.start_copy()
        if self._event is not None:
            self._event.synchronize()
        assert self._host is not None
        tokens_t, top_ids, top_values, sampled_lp = self._host
        assert tokens_t is not None
        token_list: list[int] = tokens_t.tolist()
        rows: list[dict[int, float] | None] = [None] * len(token_list)
        if self.logprob_rows:
            assert sampled_lp is not None
            sampled = sampled_lp.tolist()
            ids = [] if top_ids is None else top_ids.tolist()
            values = [] if top_values is None else top_values.tolist()
            for w, (i, count) in enumerate(
                zip(self.logprob_rows, self.logprob_counts, strict=True)
            ):
                entry: dict[int, float] = (
                    dict(zip(ids[w][:count], values[w][:count], strict=True)) if count else {}
                )
                entry[token_list[i]] = float(sampled[w])
                rows[i] = entry
        return token_list, rows
