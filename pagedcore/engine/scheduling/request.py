"""One sequence inside the engine: its tokens, progress and status."""

from __future__ import annotations

import enum
import time
from array import array
from collections.abc import Collection, Sequence
from operator import attrgetter

from pagedcore.engine.outputs import RequestMetrics
from pagedcore.engine.sampling.sampling_params import SamplingParams

__all__ = [
    "FINISHED_VALUES",
    "FinishReason",
    "Request",
    "RequestStatus",
    "finish_reason_of_value",
    "get_block_capacity",
    "get_request_id",
    "get_token_list",
    "token_slice",
]


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    #: The step computing it failed (see `pagedcore.engine.errors.EngineStepError`).
    FINISHED_ERROR = "finished_error"

    @property
    def finished(self) -> bool:
        # By value: a str hash is cached, an enum member's is a Python-level call (this runs
        # several times per request per step).
        return self._value_ in _FINISHED_VALUES


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}
_FINISHED_VALUES = frozenset(status.value for status in _FINISHED)
#: The values of the finished statuses: ``request.status._value_ in FINISHED_VALUES`` is
#: ``request.status.finished`` without the property call (for loops over many requests).
FINISHED_VALUES = _FINISHED_VALUES


class FinishReason(str, enum.Enum):
    """Why a request stopped (the strings vLLM users know)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}
#: `_REASONS` by status value (see `RequestStatus.finished`).
_REASONS_BY_VALUE = {status.value: reason for status, reason in _REASONS.items()}


class Request:
    """A single sequence: prompt + generated tokens, and how far the KV cache covers them.

    Satisfies the KV-cache manager's request protocol (`request_id`, `all_token_ids`,
    `num_prompt_tokens`, `num_computed_tokens`, `cache_salt`, `lora_name`).

    The prompt's ids are copied: converted to Python ints (floats, numpy ints and the like
    are accepted), or with ``checked=True`` (ids already checked to be Python ints, as the
    engine's prompt check leaves them) only shallow-copied, the cheaper copy inside a long
    prompt's time to first token. ``prompt_bytes``: the same ids packed as little-endian
    int64 (`prompt_bytes` attribute; ignored when its length does not match the prompt's).
    """

    __slots__ = (
        "_all_token_ids",
        "_num_prompt_tokens",
        "arrival_index",
        "bad_words_token_ids",
        "block_capacity",
        "cache_salt",
        "eos_token_ids",
        "logprobs",
        "lora_name",
        "metrics",
        "num_cached_tokens",
        "num_computed_tokens",
        "params",
        "placeholder",
        "prompt_bytes",
        "prompt_logprobs",
        "request_id",
        "sample_index",
        "status",
        "stop_reason",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        arrival_index: int,
        eos_token_ids: Collection[int] = (),
        sample_index: int = 0,
        arrival_time: float | None = None,
        checked: bool = False,
        prompt_bytes: bytes | None = None,
    ) -> None:
        self.request_id = request_id
        ids: list[int]
        if checked:  # Python ints already (the engine's prompt check): a shallow copy
            ids = list(prompt_token_ids)
        else:
            try:  # at C speed: the prompt is copied inside its time to first token
                ids = array("q", prompt_token_ids).tolist()
            except (TypeError, OverflowError):  # floats, huge ints, ...: converted one by one
                ids = [int(t) for t in prompt_token_ids]
        self._all_token_ids = ids
        self._num_prompt_tokens = len(self._all_token_ids)
        #: The prompt's ids packed as little-endian int64 (the engine's prompt check packs
        #: them to check their range; the prefix-cache hashes slice them instead of packing
        #: the prompt again), or None.
        self.prompt_bytes = (
            prompt_bytes
            if prompt_bytes is not None and len(prompt_bytes) == 8 * len(ids)
            else None
        )
        self.params = params
        self.arrival_index = arrival_index
        #: Tokens that end the request unless ``params.ignore_eos`` (every EOS id of the model).
        self.eos_token_ids = frozenset(eos_token_ids)
        #: The EOS / stop token id or the stop string that finished the request, else None.
        self.stop_reason: int | str | None = None
        self.sample_index = sample_index
        self.cache_salt = params.cache_salt
        self.lora_name: str | None = None
        self.num_computed_tokens = 0
        #: With overlap scheduling: the input id standing for the token the step in flight
        #: samples for this request (negative, see `pagedcore.engine.runner.overlap`), until
        #: that token reaches the host; counted by `num_tokens`, absent from the token ids.
        #: None: no token in flight.
        self.placeholder: int | None = None
        #: Tokens the request's KV blocks can hold (kept by the scheduler's `RequestBlocks`
        #: when its decode fast path is on; 0 while it holds no blocks).
        self.block_capacity = 0
        #: Prompt tokens found in the prefix cache when first scheduled; None before that.
        self.num_cached_tokens: int | None = None
        self.status = RequestStatus.WAITING
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        #: With ``params.prompt_logprobs``: entry ``i`` is ``{token: logprob}`` of prompt token
        #: ``i + 1`` (from the logits at position ``i``), filled chunk by chunk as the prompt is
        #: computed (a recomputation after preemption skips the entries it has); else None.
        self.prompt_logprobs: list[dict[int, float]] | None = (
            [] if params.prompt_logprobs is not None else None)
        #: ``params.bad_words`` as token-id sequences (set by the engine, which tokenizes).
        self.bad_words_token_ids: list[list[int]] = []
        self.metrics = RequestMetrics(
            arrival_time=time.perf_counter() if arrival_time is None else arrival_time
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens}, "
            f"{self.status.value})"
        )

    @property
    def all_token_ids(self) -> Sequence[int]:
        """Prompt followed by the generated tokens."""
        return self._all_token_ids

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._all_token_ids[: self._num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self._all_token_ids[self._num_prompt_tokens :]

    @property
    def num_prompt_tokens(self) -> int:
        return self._num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        """Known tokens, plus the one in flight (see `placeholder`)."""
        return len(self._all_token_ids) + (self.placeholder is not None)

    @property
    def num_output_tokens(self) -> int:
        return len(self._all_token_ids) - self._num_prompt_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        """True while prompt log-probabilities are asked for and some are not computed yet
        (the request then takes no prefix-cache hit: the skipped positions have no logits)."""
        entries = self.prompt_logprobs
        return entries is not None and len(entries) < self._num_prompt_tokens - 1

    @property
    def priority_key(self) -> tuple[int, int]:
        """Smaller is served first and preempted last: (priority, arrival order)."""
        return (self.params.priority, self.arrival_index)

    @property
    def finish_reason(self) -> FinishReason | None:
        return _REASONS_BY_VALUE.get(self.status._value_)

    def append_token(self, token_id: int, logprobs: dict[int, float] | None = None) -> None:
        """Record a generated token (and its log-probabilities when requested: the sampler's
        `TokenLogprobs`, which also carries the sampled token's rank)."""
        self._all_token_ids.append(int(token_id))
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(logprobs)


#: ``get_token_list(request)``: the request's prompt-and-output token-id list itself (not a
#: copy; do not mutate). With `map` it reads many requests at C speed (the host hot path).
get_token_list = attrgetter("_all_token_ids")
#: ``get_request_id(request)``: ``request.request_id`` (for `map`).
get_request_id = attrgetter("request_id")


def token_slice(request: Request, start: int, end: int) -> Sequence[int]:
    """Token ids ``[start, end)`` of `request`, its placeholder standing for the token in
    flight (the last one) when the range reaches it."""
    tokens = request.all_token_ids
    mark = getattr(request, "placeholder", None)  # (a TP worker's planned view has none)
    if mark is None or end <= len(tokens):
        return tokens[start:end]
    return [*tokens[start:end], mark]


#: ``finish_reason_of_value(value)``: the `FinishReason` of a `RequestStatus` value (None
#: while not finished): ``request.finish_reason`` of ``request.status.value``.
finish_reason_of_value = _REASONS_BY_VALUE.get

#: ``get_block_capacity(request)``: ``request.block_capacity`` (for `map`).
get_block_capacity = attrgetter("block_capacity")
