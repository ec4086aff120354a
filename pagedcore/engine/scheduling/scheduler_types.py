"""The scheduler's vocabulary: its config, its per-step output, its counters, and the part of
the KV-cache manager it relies on."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import pairwise
from typing import Any, Literal, Protocol, overload

import attrs

from pagedcore.engine.scheduling.request import Request

__all__ = [
    "DecodeBatch",
    "KVManagerLike",
    "ScheduledRequest",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
]


class KVManagerLike(Protocol):
    """The part of `pagedcore.kv_cache.KVCacheManager` the scheduler uses."""

    def get_computed_blocks(self, request: Any, *, use_cache: bool = True) -> tuple[Any, int]: ...

    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        *,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Any = None,
        num_lookahead_tokens: int = 0,
    ) -> Any: ...

    def free(self, request: Any) -> None: ...

    def uncache_unwritten_blocks(self, request_id: str, num_valid_tokens: int) -> int: ...

    def shares_blocks_from(self, request_id: str, num_tokens: int) -> bool: ...

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]: ...

    @property
    def usage(self) -> float: ...


@attrs.frozen(kw_only=True)
class SchedulerConfig:
    """Limits of one engine step.

    Attributes
    ----------
    max_num_seqs:
        Requests in one step at most.
    max_num_batched_tokens:
        Tokens (prefill + decode) in one step at most.
    max_model_len:
        Longest sequence (prompt + output) a request may reach.
    enable_chunked_prefill:
        Split prompts across steps; when False a prompt must fit the budget whole.
    long_prefill_token_threshold:
        A prefill step of one request takes at most this many tokens (None: no cap).
    policy:
        "fcfs" or "priority" (lower `SamplingParams.priority` first, then arrival).
    token_buckets:
        Step sizes (tokens, ascending) that run without padding: the token buckets of the
        captured mixed-step CUDA graphs (`pagedcore.engine.runner.mixed_graphs`). When set, a step
        that holds a *partial* prefill chunk and would total a few tokens above a bucket has
        that chunk shrunk so the step totals exactly the largest bucket below (see
        `Scheduler`). None: off (eager engines, CPU).
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int | None = None
    policy: Literal["fcfs", "priority"] = "fcfs"
    token_buckets: tuple[int, ...] | None = None

    def __attrs_post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 1:
            raise ValueError(
                "long_prefill_token_threshold must be None or a positive integer, got "
                f"{self.long_prefill_token_threshold!r}"
            )
        buckets = self.token_buckets
        if buckets is not None and (
            not isinstance(buckets, tuple)
            or not buckets
            or any(not isinstance(b, int) or b < 1 for b in buckets)
            or any(a >= b for a, b in pairwise(buckets))
        ):
            raise ValueError(
                "token_buckets must be None or a non-empty tuple of positive integers in "
                f"strictly ascending order, got {buckets!r}"
            )
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len}) so any prompt fits one step; "
                "raise it or enable chunked prefill"
            )


class ScheduledRequest:
    """One request's share of a step: tokens ``[start, start + num_new_tokens)``.

    A plain slotted class (one is made per running request per step; attrs' frozen
    ``__init__`` costs twice as much). Treat it as immutable.

    Attributes
    ----------
    request:
        The request.
    start:
        Its tokens already computed before this step.
    num_new_tokens:
        Tokens this step computes.
    samples:
        True when the step reaches the request's last known token, so it yields logits.
    """

    __slots__ = ("num_new_tokens", "request", "samples", "start")

    def __init__(
        self, request: Request, start: int, num_new_tokens: int, *, samples: bool | None = None
    ) -> None:
        self.request = request
        self.start = start
        self.num_new_tokens = num_new_tokens
        #: None: derived from the request (pass it only when known, as a hot-path shortcut).
        self.samples = start + num_new_tokens == request.num_tokens if samples is None else samples

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    def __repr__(self) -> str:
        return (f"ScheduledRequest({self.request.request_id!r}, start={self.start}, "
                f"num_new_tokens={self.num_new_tokens})")


class DecodeBatch(Sequence[ScheduledRequest]):
    """The `ScheduledRequest` of each request of an all-decode step, made only when asked.

    At 256 running requests, making one `ScheduledRequest` per request per step costs more
    host time than the rest of scheduling; the hot consumers (the input batch, the sampler
    call, `Scheduler.update_from_output`) read `requests` and `starts` instead. Every item is
    a single-token decode that samples: ``ScheduledRequest(requests[i], starts[i], 1)``.

    Parameters
    ----------
    requests:
        The step's requests, in batch order (the running order).
    starts:
        Each request's computed tokens before the step (its one query token's position).
    """

    __slots__ = ("_items", "changed", "requests", "starts", "token_ids")

    def __init__(self, requests: Sequence[Request], starts: Sequence[int]) -> None:
        if len(requests) != len(starts):
            raise ValueError(f"{len(requests)} requests but {len(starts)} starts")
        self.requests = requests
        self.starts = starts
        self._items: list[ScheduledRequest] | None = None
        #: Hints the engine may set before input preparation (None: unknown). `changed`: the
        #: requests whose block ids changed since the previous step was prepared (the input
        #: batch then rechecks only their block-table rows when the request list is the
        #: previous step's). `token_ids`: each request's last token, when known without
        #: reading the requests (the tokens the previous step sampled for this same list).
        self.changed: set[Request] | None = None
        self.token_ids: list[int] | None = None

    @property
    def items(self) -> list[ScheduledRequest]:
        """The `ScheduledRequest`s (made on first use)."""
        if self._items is None:
            self._items = [ScheduledRequest(r, s, 1, samples=True)
                           for r, s in zip(self.requests, self.starts, strict=True)]
        return self._items

    def __len__(self) -> int:
        return len(self.requests)

    @overload
    def __getitem__(self, index: int) -> ScheduledRequest: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[ScheduledRequest]: ...

    def __getitem__(self, index: int | slice) -> ScheduledRequest | Sequence[ScheduledRequest]:
        return self.items[index]

    def __iter__(self) -> Iterator[ScheduledRequest]:
        return iter(self.items)

    def __repr__(self) -> str:
        return f"DecodeBatch({len(self)} requests)"


@attrs.frozen
class SchedulerOutput:
    """What the model runner executes this step.

    `scheduled` is a tuple, or a `DecodeBatch` for a step of single-token decodes of every
    running request (the all-decode fast path).
    """

    scheduled: Sequence[ScheduledRequest]
    preempted: tuple[Request, ...] = ()
    #: Requests that can never be served, finished with an error during this schedule().
    rejected: tuple[Request, ...] = ()
    #: Tokens of the step (None: counted from `scheduled` when asked).
    total_tokens: int | None = None

    @property
    def num_scheduled_tokens(self) -> int:
        if self.total_tokens is not None:
            return self.total_tokens
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@attrs.define
class SchedulerStats:
    """Counters since the scheduler was created."""

    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0
    kv_cache_usage: float = 0.0
    prompt_tokens: int = 0
    prefix_hit_tokens: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
