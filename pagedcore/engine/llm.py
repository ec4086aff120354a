"""`LLM`: the user-facing engine (offline `generate`, online `add_request` / `step`).

The offline API (`generate`, `stream`) lives in `pagedcore.engine.llm_offline`
(`OfflineGeneration`, a base class of `LLM`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Literal

from pagedcore.engine.arguments import DEFAULT_MAX_LOGPROBS, DEFAULT_MAX_N, check_engine_args
from pagedcore.engine.engine_builder import build_engine
from pagedcore.engine.errors import EngineStepError
from pagedcore.engine.llm_failures import FailureIsolation
from pagedcore.engine.llm_offline import OfflineGeneration
from pagedcore.engine.llm_overlap import InflightStep, OverlapStep
from pagedcore.engine.output_builder import (
    ParentRequest,
    PromptType,
    make_children,
    tokenize,
)
from pagedcore.engine.outputs import RequestOutput
from pagedcore.engine.request_checks import check_request, check_unique_ids
from pagedcore.engine.runner.overlap import InputFence, async_scheduling_setting
from pagedcore.engine.sampling.sampler import Sampler
from pagedcore.engine.sampling.sampling_params import SamplingParams
from pagedcore.engine.scheduling.request import Request, RequestStatus, get_request_id
from pagedcore.engine.scheduling.scheduler import DecodeBatch, SchedulerOutput
from pagedcore.engine.validation import InvalidArgumentTypeError, describe

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

    from pagedcore.engine.distributed.executor import TensorParallelExecutor
    from pagedcore.engine.runner.model_runner import ModelRunner

__all__ = ["LLM", "EngineStepError", "PromptType"]

_get_params = attrgetter("params")


class LLM(OverlapStep, FailureIsolation, OfflineGeneration):
    """A continuous-batching engine over a transformers causal LM and pagedcore backends.

    Parameters
    ----------
    model:
        A local checkpoint directory, ``"demo"``, ``"random:<type>"``, a transformers config
        (seeded random weights) or a loaded model (its attention implementation is switched to
        ``"pagedcore"``).
    dtype:
        Model dtype (None: bfloat16 on CUDA, float32 on CPU).
    device:
        ``"cpu"``, ``"cuda"`` (None: CUDA when available).
    block_size:
        Tokens per KV-cache block.
    max_model_len:
        Longest prompt + output (None: the model's ``max_position_embeddings``).
    max_num_seqs, max_num_batched_tokens:
        Requests and tokens per step at most.
    enable_prefix_caching:
        Reuse KV blocks of shared prompt prefixes.
    enable_chunked_prefill, long_prefill_token_threshold:
        Split long prompts across steps; cap one request's prefill tokens per step.
    kv_cache_memory_bytes:
        KV-cache budget (None: 64 MiB on CPU; on CUDA `gpu_memory_utilization` of the device
        minus what is in use and an activation reserve).
    gpu_memory_utilization:
        Fraction of the GPU pagedcore may fill (with `kv_cache_memory_bytes` None).
    backend:
        Force an attention backend by name (no fallback).
    seed:
        Seed of random weights and of sampling without a per-request seed.
    scheduling_policy:
        ``"fcfs"`` or ``"priority"``.
    tokenizer:
        Overrides the model's tokenizer (anything with ``encode`` and ``decode``).
    tensor_parallel_size:
        Shard attention heads and the MLP over this many processes (torch.distributed: gloo on
        CPU, NCCL on CUDA with rank r on ``cuda:r``); 1 runs in this process. With N > 1,
        `model` must be loadable by every rank (not a loaded model) and the KV-cache budget is
        per rank; ``llm.runner.shutdown()`` stops the workers (also done at exit). See
        ``docs/distributed.md``.
    enforce_eager:
        Never use CUDA graphs. By default, on CUDA with backends that declare
        ``cudagraph_support >= UNIFORM_SINGLE_TOKEN_DECODE``, steps whose every request has
        one query token replay a graph captured at start-up for their batch-size bucket
        (``stats()["cudagraph"]`` says whether graphs are on, and why not).
    cudagraph_capture_sizes:
        The buckets (None: 1, 2, 4, 8, 16, 24, ... up to `max_num_seqs`).
    align_chunks_to_buckets:
        True: when mixed steps replay CUDA graphs (`pagedcore.engine.runner.mixed_graphs`), shrink a
        partial prefill chunk so its step totals exactly a token bucket instead of padding up
        to the next one (``SchedulerConfig.token_buckets``; never the final chunk of a
        prompt, never below half the chunk). False: never. A sequence of token counts:
        align to those, with or without graphs (tests).
    max_logprobs:
        Largest `SamplingParams.logprobs` a request may ask for (20, as in vLLM).
    max_n:
        Largest `SamplingParams.n` (samples per prompt) a request may ask for (256).
    hash_algo, hash_seed:
        Prefix-cache block hashing: ``"sha256"`` (default) or ``"xxhash"``, and the seed of
        the hash chain (an int or bytes; None: random per process).
    async_scheduling:
        Overlap scheduling: schedule and prepare step N+1 while step N runs on the device;
        sampled ids feed the next step on the device, and reach the host (stop checks,
        outputs) one step behind (`pagedcore.engine.llm_overlap`). None: on with CUDA, off
        on the CPU; ``PAGEDCORE_ASYNC_SCHEDULING=0/1`` overrides. Outputs are the same
        either way (``stats()["async_scheduling"]`` says whether it is on, and why not).

    Raises
    ------
    InvalidArgumentError
        (a ValueError; also a TypeError for a wrong type) An argument of the wrong type or out
        of range, before anything is loaded; the message names every bad argument.

    Examples
    --------
    >>> llm = LLM("demo", device="cpu", max_model_len=256)  # doctest: +SKIP
    >>> out = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))  # doctest: +SKIP
    >>> out[0].outputs[0].token_ids  # doctest: +SKIP
    """

    def __init__(
        self,
        model: str | PretrainedConfig | PreTrainedModel,
        *,
        dtype: Any = None,
        device: Any = None,
        block_size: int = 16,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        long_prefill_token_threshold: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float = 0.9,
        backend: str | None = None,
        seed: int = 0,
        scheduling_policy: Literal["fcfs", "priority"] = "fcfs",
        tokenizer: Any = None,
        tensor_parallel_size: int = 1,
        enforce_eager: bool = False,
        cudagraph_capture_sizes: Sequence[int] | None = None,
        align_chunks_to_buckets: bool | Sequence[int] = True,
        max_logprobs: int = DEFAULT_MAX_LOGPROBS,
        max_n: int = DEFAULT_MAX_N,
        hash_algo: str = "sha256",
        hash_seed: bytes | int | None = None,
        async_scheduling: bool | None = None,
    ) -> None:
        if async_scheduling is not None and not isinstance(async_scheduling, bool):
            raise InvalidArgumentTypeError(
                f"async_scheduling must be True, False or None (the device's default), got "
                f"{describe(async_scheduling)}"
            )
        # A bad PAGEDCORE_ASYNC_SCHEDULING is reported before anything loads.
        async_scheduling_setting(async_scheduling, device_type="cpu")
        check_engine_args(
            block_size=block_size, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill,
            long_prefill_token_threshold=long_prefill_token_threshold,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            gpu_memory_utilization=gpu_memory_utilization, backend=backend, seed=seed,
            scheduling_policy=scheduling_policy, tokenizer=tokenizer,
            tensor_parallel_size=tensor_parallel_size, enforce_eager=enforce_eager,
            cudagraph_capture_sizes=cudagraph_capture_sizes,
            align_chunks_to_buckets=align_chunks_to_buckets, max_logprobs=max_logprobs,
            max_n=max_n, hash_algo=hash_algo, hash_seed=hash_seed,
        )
        parts = build_engine(
            model, dtype=dtype, device=device, block_size=block_size,
            max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill,
            long_prefill_token_threshold=long_prefill_token_threshold,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            gpu_memory_utilization=gpu_memory_utilization, backend=backend, seed=seed,
            scheduling_policy=scheduling_policy, tokenizer=tokenizer,
            tensor_parallel_size=tensor_parallel_size, enforce_eager=enforce_eager,
            cudagraph_capture_sizes=cudagraph_capture_sizes,
            align_chunks_to_buckets=align_chunks_to_buckets,
            hash_algo=hash_algo, hash_seed=hash_seed,
        )
        #: Engine-level bounds on one request (see `check_request`).
        self.max_logprobs = max_logprobs
        self.max_n = max_n
        self.device = parts.device
        self.dtype = parts.dtype
        self.model = parts.model
        self.model_name = parts.model_name
        self.tokenizer = parts.tokenizer
        self.eos_token_id = parts.eos_token_id
        self.max_model_len = parts.max_model_len
        self.scheduler_config = parts.scheduler_config
        self.kv_cache_config = parts.kv_cache_config
        self.kv_cache_manager = parts.kv_cache_manager
        self.scheduler = parts.scheduler
        self.runner: ModelRunner | TensorParallelExecutor = parts.runner
        self.sampler = Sampler(seed=seed)
        self._parents: dict[str, ParentRequest] = {}
        self._child_parent: dict[str, ParentRequest] = {}
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        #: Seconds spent in schedule + input preparation, and in whole steps.
        self.host_time = 0.0
        self.step_time = 0.0
        #: Seconds per phase of the steps: ``schedule``, ``prepare``, ``execute`` (the
        #: forward and sampling, which waits for the device), ``update`` (appending tokens,
        #: retiring requests, building outputs).
        #: With overlap, ``wait``: the host waiting for the previous step's sampled ids.
        self.phase_time = dict.fromkeys(
            ("schedule", "prepare", "execute", "update", "wait"), 0.0)
        self.num_steps = 0
        #: Tokens the scheduler gave the last step (prompt chunks + decodes; 0 before any).
        self.last_step_num_scheduled_tokens = 0
        # The requests the last step sampled and their tokens (see `_run`).
        self._prev_rows: list[Request] | None = None
        self._prev_tokens: list[int] | None = None
        # Requests whose own sampling setup failed in the last `_run` (id -> reason).
        self._row_failures: dict[str, str] = {}
        # Overlap scheduling (`OverlapStep`): the step in flight and the input-buffer fence.
        self._inflight: InflightStep | None = None
        self._fence = InputFence()
        self._tensor_parallel = int(getattr(self.runner, "world_size", 1)) > 1
        self._async_requested = async_scheduling
        self.async_scheduling = False
        #: Why overlap scheduling is off (None while it is on).
        self.async_scheduling_reason: str | None = None
        self.set_async_scheduling(async_scheduling)

    # ---- properties ------------------------------------------------------------------------

    @property
    def backend_names(self) -> list[str]:
        """The attention backend of each KV-cache group."""
        return self.runner.backend_names

    def stats(self) -> dict[str, Any]:
        """Running/waiting counts, preemptions, KV usage, prefix hits, backends, timings."""
        s = self.scheduler.stats
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "preemptions": s.num_preemptions,
            "kv_cache_usage": float(self.kv_cache_manager.usage),
            "prompt_tokens": s.prompt_tokens,
            "prefix_hit_tokens": s.prefix_hit_tokens,
            "prefix_hit_rate": s.prefix_hit_rate,
            "num_blocks": self.kv_cache_config.num_blocks,
            "backends": self.backend_names,
            "steps": self.num_steps,
            "host_time_s": self.host_time,
            "step_time_s": self.step_time,
            "cudagraph": self.cudagraph_status(),
            "async_scheduling": {"enabled": self.async_scheduling,
                                 "reason": self.async_scheduling_reason},
        }

    def set_async_scheduling(self, enabled: bool | None) -> bool:
        """Turn overlap scheduling on or off (None: the device's default; the environment
        variable ``PAGEDCORE_ASYNC_SCHEDULING`` still overrides). A step in flight is
        finished first (its outputs are lost to the caller: switch between requests).
        Returns whether it is on; ``async_scheduling_reason`` says why not."""
        self.drain()
        self.async_scheduling, self.async_scheduling_reason = async_scheduling_setting(
            enabled, device_type=self.device.type)
        return self.async_scheduling

    def cudagraph_status(self) -> dict[str, Any]:
        """Whether decode steps replay CUDA graphs: ``{"enabled", "reason", "sizes",
        "capture_seconds"}`` (``reason`` says why not when disabled)."""
        # With tensor parallelism: rank 0's runner (every rank captured the same graphs).
        runner: Any = getattr(self.runner, "local_runner", self.runner)
        graphs = getattr(runner, "graphs", None)
        if graphs is None:
            reason = getattr(runner, "cudagraph_disabled_reason", None) or "not available"
            return {"enabled": False, "reason": reason, "sizes": [], "capture_seconds": 0.0}
        mixed = getattr(runner, "mixed_graphs", None)
        return {"enabled": True, "reason": None, "sizes": list(graphs.sizes),
                "capture_seconds": graphs.capture_seconds,
                # Mixed/prefill steps (pagedcore.engine.runner.mixed_graphs): token buckets.
                "mixed_sizes": [] if mixed is None else list(mixed.sizes),
                "mixed_capture_seconds": 0.0 if mixed is None else mixed.capture_seconds,
                "mixed_reason": getattr(runner, "mixed_graphs_disabled_reason", None)}

    # ---- requests --------------------------------------------------------------------------

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return tokenize(
            prompt, tokenizer=self.tokenizer, model_name=self.model_name,
            vocab_size=int(self.model.config.vocab_size),
        )

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
    ) -> None:
        """Queue a request for `step()`.

        Raises
        ------
        ValueError
            (nothing queued) A bad id, prompt or params, a request over the engine's bounds
            (``max_logprobs``, ``max_n``, ``max_model_len``, the KV cache), or an id already
            in use by this request or one of its samples.
        """
        params = check_request(params, max_logprobs=self.max_logprobs, max_n=self.max_n)
        if not isinstance(request_id, str):
            raise InvalidArgumentTypeError(f"request_id must be a str, got {describe(request_id)}")
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        text, ids = self._tokenize(prompt)
        self.scheduler.check_fits(len(ids), params.max_tokens)
        parent = ParentRequest(request_id, text, ids)
        children = make_children(
            parent, params, arrivals=self._arrivals, eos_token_id=self.eos_token_id,
            now=time.perf_counter(),
        )
        # All samples or none: check every id before queueing the first.
        check_unique_ids(children, self.scheduler.requests, self._child_parent)
        added: list[Request] = []
        try:
            for child in children:
                self.scheduler.add_request(child)
                added.append(child)
        except BaseException:
            if added:
                self.scheduler.abort([c.request_id for c in added], now=time.perf_counter())
            raise
        for child in children:
            self._child_parent[child.request_id] = parent
        self._parents[request_id] = parent

    def abort(self, request_id: str) -> RequestOutput:
        """Stop a request (all its samples) and free its blocks; KeyError for an unknown id.

        Never raises otherwise: the final output is built even when the tokenizer fails.
        """
        parent = self._parents.get(request_id)
        if parent is None:
            raise KeyError(
                f"cannot abort unknown or already finished request {request_id!r}; "
                f"{len(self._parents)} request(s) are in the engine"
            )
        alive = [c for c in parent.children if not c.status.finished]
        queued = [c.request_id for c in alive if c.request_id in self.scheduler.requests]
        if queued:
            self.scheduler.abort(queued, now=time.perf_counter())
        for child in alive:
            if not child.status.finished:  # not in the scheduler any more: nothing to free
                child.status = RequestStatus.FINISHED_ABORTED
            self.sampler.forget(child.request_id)
        return self._output(parent)

    def has_unfinished_requests(self) -> bool:
        """True while a request can still run. Requests left with nothing that can run
        (only possible after an internal failure) are finished with an error here."""
        if self.scheduler.has_unfinished_requests():
            return True
        if self._parents:
            self._reap_orphans()
        return bool(self._parents)

    def step(self, *, finished_only: bool = False) -> list[RequestOutput]:
        """Run one engine step; return the outputs of the requests that changed.

        With overlap scheduling (``async_scheduling``) a call launches the next step and
        returns what the step launched by the previous call produced: outputs arrive one
        call later, and the same tokens arrive as without overlap.

        Parameters
        ----------
        finished_only:
            Return (and build) only the outputs of requests that finished: an offline loop
            needs no others, and building one per running request per step costs host time.

        Raises
        ------
        EngineStepError
            The model runner, a backend or the sampler raised. The step's requests (and their
            sibling samples) are finished with ``finish_reason == "error"``, their blocks
            freed, their outputs (tokens generated so far included) in ``.outputs``; the
            engine keeps serving everything else. A `TensorParallelError` (a rank failed: the
            engine is stopped) is raised as is, after finishing every request with an error.
        """
        if self.async_scheduling:
            return self._step_overlap(finished_only=finished_only)
        t0 = time.perf_counter()
        scheduled = self.scheduler.schedule()
        self.last_step_num_scheduled_tokens = int(scheduled.num_scheduled_tokens)
        phases = self.phase_time
        phases["schedule"] += time.perf_counter() - t0
        try:
            sampled = self._run(scheduled, t0)
        except BaseException as exc:
            self._fail_step(scheduled, exc)
        t_update = time.perf_counter()
        try:
            changed = self.scheduler.update_from_output(scheduled, sampled, now=t_update)
        except BaseException as exc:
            self._fail_step(scheduled, exc)
        if self._row_failures:
            changed += self._fail_rows(self._row_failures, now=t_update)
            self._row_failures = {}
        for request in changed:
            if request.status.finished:
                self.sampler.forget(request.request_id)
        return self._end_step(changed, finished_only=finished_only, t0=t0, t_update=t_update)

    def _end_step(
        self, changed: list[Request], *, finished_only: bool, t0: float, t_update: float
    ) -> list[RequestOutput]:
        """A step's outputs (`_collect_outputs`), its update time and count recorded."""
        outputs = self._collect_outputs(changed, finished_only=finished_only)
        t_end = time.perf_counter()
        self.phase_time["update"] += t_end - t_update
        self.step_time += t_end - t0
        self.num_steps += 1
        return outputs

    def _collect_outputs(
        self, changed: list[Request], *, finished_only: bool
    ) -> list[RequestOutput]:
        """The outputs of the user requests `changed` touched (with `finished_only`: of those
        whose every sample finished)."""
        if finished_only:
            done = self._parents_of(r for r in changed if r.status.finished).values()
            parents = [p for p in done if all(c.status.finished for c in p.children)]
        else:
            parents = list(self._parents_of(changed).values())
        return [self._output(p) for p in parents]

    def _run(
        self, scheduled: SchedulerOutput, t0: float
    ) -> dict[str, tuple[int, dict[int, float] | None]]:
        """Prepare, execute and sample a scheduled step: the sampled token of each request."""
        sampled: dict[str, tuple[int, dict[int, float] | None]] = {}
        phases = self.phase_time
        if scheduled.is_empty:
            self.host_time += time.perf_counter() - t0
            return sampled
        t_prepare = time.perf_counter()
        step = scheduled.scheduled
        blocks = self.scheduler.blocks
        changed = blocks.take_changed()
        if isinstance(step, DecodeBatch):
            step.changed = changed
            if self._prev_rows is not None and step.requests == self._prev_rows:
                # (List equality of the same objects: pointer compares, no request read.)
                step.token_ids = self._prev_tokens
        self._prev_rows = self._prev_tokens = None
        inputs = self.runner.prepare(step, blocks.ids.__getitem__)
        t_execute = time.perf_counter()
        self.host_time += t_execute - t0
        phases["prepare"] += t_execute - t_prepare
        logits = self.runner.execute(inputs)
        rows = inputs.sample_rows
        if rows:
            requests = (rows.requests if isinstance(rows, DecodeBatch)
                        else [r.request for r in rows])
            ids = list(map(get_request_id, requests))
            tokens, logprobs = self.sampler.sample(
                logits, list(map(_get_params, requests)), ids
            )
            sampled = dict(zip(ids, zip(tokens, logprobs, strict=True), strict=True))
            if self.sampler.row_errors:
                # These requests alone fail (in `step`); their rows' tokens are not kept.
                self._row_failures = dict(self.sampler.row_errors)
                for failed_id in self._row_failures:
                    sampled.pop(failed_id, None)
            else:
                # update_from_output appends these: the next step's input ids if it decodes
                # exactly these requests.
                self._prev_rows, self._prev_tokens = list(requests), tokens
        phases["execute"] += time.perf_counter() - t_execute
        return sampled
