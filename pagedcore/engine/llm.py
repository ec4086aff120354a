"""`LLM`: the user-facing engine (offline `generate`, online `add_request` / `step`).

The offline API (`generate`, `stream`) lives in `pagedcore.engine.llm_offline`
(`OfflineGeneration`, a base class of `LLM`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from pagedcore.engine.arguments import DEFAULT_MAX_LOGPROBS, DEFAULT_MAX_N
from pagedcore.engine.detokenizer import advance_text
from pagedcore.engine.engine_args import EngineArgs
from pagedcore.engine.engine_builder import build_engine
from pagedcore.engine.errors import EngineStepError
from pagedcore.engine.llm_failures import FailureIsolation
from pagedcore.engine.llm_offline import OfflineGeneration
from pagedcore.engine.llm_overlap import InflightStep, OverlapStep
from pagedcore.engine.output_builder import (
    ParentRequest,
    PromptType,
    delta_fields,
    make_children,
    tokenize_packed,
)
from pagedcore.engine.outputs import RequestOutput
from pagedcore.engine.request_checks import check_request, check_unique_ids
from pagedcore.engine.runner.overlap import InputFence, async_scheduling_setting
from pagedcore.engine.sampling.prompt_logprobs import record_prompt_logprobs
from pagedcore.engine.sampling.resolve import (
    bad_words_token_ids,
    default_params,
    resolve_max_tokens,
)
from pagedcore.engine.sampling.sampler import Sampler
from pagedcore.engine.sampling.sampling_params import SamplingParams
from pagedcore.engine.scheduling.request import FINISHED_VALUES, Request, RequestStatus
from pagedcore.engine.scheduling.scheduler import DecodeBatch, SchedulerOutput
from pagedcore.engine.stats_logging import StatsLogger
from pagedcore.engine.validation import InvalidArgumentTypeError, check_flag, describe

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

    from pagedcore.engine.distributed.executor import TensorParallelExecutor
    from pagedcore.engine.runner.model_runner import ModelRunner

__all__ = ["LLM", "EngineStepError", "PromptType"]


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
    kv_cache_dtype:
        ``"auto"`` (the model dtype) or ``"fp8"`` / ``"fp8_e4m3"`` / ``"fp8_e5m2"``: the KV
        cache is stored in fp8 (half the bytes of bf16, so about twice the blocks for the same
        memory) with per-layer K/V scales from the checkpoint, else computed on the first
        prefill (`stats()["kv_scales"]` says which).
    trust_remote_code:
        Let a checkpoint's own Python code (its config and model classes) run.
    log_stats, log_interval:
        Log a stats line every `log_interval` seconds through logger ``pagedcore.engine``
        (off by default in the library; the CLI turns it on).
    async_scheduling:
        Overlap scheduling: schedule and prepare step N+1 while step N runs on the device;
        sampled ids feed the next step on the device, and reach the host (stop checks,
        outputs) one step behind (`pagedcore.engine.llm_overlap`). None: on with CUDA, off
        on the CPU; ``PAGEDCORE_ASYNC_SCHEDULING=0/1`` overrides. Outputs are the same
        either way (``stats()["async_scheduling"]`` says whether it is on, and why not).

    Every keyword is a field of `EngineArgs` (same name, default and help);
    ``LLM.from_engine_args(args)`` builds from one directly.

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
        kv_cache_dtype: str = "auto",
        trust_remote_code: bool = False,
        log_stats: bool = False,
        log_interval: float = 10.0,
        async_scheduling: bool | None = None,
    ) -> None:
        args = EngineArgs(
            model=model, dtype=dtype, device=device, block_size=block_size,
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
            align_chunks_to_buckets=align_chunks_to_buckets, max_logprobs=max_logprobs,
            max_n=max_n, hash_algo=hash_algo, hash_seed=hash_seed,
            kv_cache_dtype=kv_cache_dtype, trust_remote_code=trust_remote_code,
            log_stats=log_stats, log_interval=log_interval, async_scheduling=async_scheduling,
        )
        self._init_from_args(args)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        """An engine built from `args` (what the CLI commands do)."""
        llm = cls.__new__(cls)
        llm._init_from_args(args)
        return llm

    def _init_from_args(self, args: EngineArgs) -> None:
        # A bad PAGEDCORE_ASYNC_SCHEDULING is reported before anything loads.
        async_scheduling_setting(args.async_scheduling, device_type="cpu")
        #: The options this engine was built with.
        self.engine_args = args
        parts = build_engine(args)
        max_logprobs, max_n, seed = args.max_logprobs, args.max_n, args.seed
        #: Engine-level bounds on one request (see `check_request`).
        self.max_logprobs = max_logprobs
        self.max_n = max_n
        self.device = parts.device
        self.dtype = parts.dtype
        self.model = parts.model
        self.model_name = parts.model_name
        self.tokenizer = parts.tokenizer
        #: Why `tokenizer` is None (e.g. which files the checkpoint lacks); None if there is one.
        self.no_tokenizer_reason = None if self.tokenizer is not None else parts.no_tokenizer_reason
        #: Every EOS id of the model (each one stops a request unless ``ignore_eos``).
        self.eos_token_ids = parts.eos_token_ids
        #: The `SamplingParams` fields of the checkpoint's ``generation_config``: the defaults
        #: of a request that gives no params (`default_sampling_params`).
        self.sampling_defaults = parts.sampling_defaults
        self.max_model_len = parts.max_model_len
        self.scheduler_config = parts.scheduler_config
        self.kv_cache_config = parts.kv_cache_config
        self.kv_cache_manager = parts.kv_cache_manager
        self.scheduler = parts.scheduler
        self.runner: ModelRunner | TensorParallelExecutor = parts.runner
        self.sampler = Sampler(seed=seed)
        self._parents: dict[str, ParentRequest] = {}
        #: While a `step(deltas=...)` runs: where its fast-path delta tuples go.
        self._delta_sink: list[tuple[Any, ...]] | None = None
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
        #: Tokens sampled so far (every sample of every request).
        self.num_generated_tokens = 0
        self._stats_logger = StatsLogger(args.log_interval) if args.log_stats else None
        #: Tokens the scheduler gave the last step (prompt chunks + decodes; 0 before any).
        self.last_step_num_scheduled_tokens = 0
        # The requests the last step sampled and their tokens (see `_run`).
        self._prev_rows: list[Request] | None = None
        self._prev_tokens: list[int] | None = None
        #: Live requests whose logits processors read their tokens (no overlap while any is).
        self._processing_ids: set[str] = set()
        #: Requests whose prompt logprobs are not all computed (no overlap while any is).
        self._prompt_pending: dict[str, Request] = {}
        # Requests whose own sampling setup failed in the last `_run` (id -> reason).
        self._row_failures: dict[str, str] = {}
        # Overlap scheduling (`OverlapStep`): the step in flight and the input-buffer fence.
        self._inflight: InflightStep | None = None
        self._fence = InputFence()
        self._tensor_parallel = int(getattr(self.runner, "world_size", 1)) > 1
        self._async_requested = args.async_scheduling
        self.async_scheduling = False
        #: Why overlap scheduling is off (None while it is on).
        self.async_scheduling_reason: str | None = None
        self.set_async_scheduling(args.async_scheduling)

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
            **self._kv_scale_status(),
        }

    def _kv_scale_status(self) -> dict[str, Any]:
        runner: Any = getattr(self.runner, "local_runner", self.runner)
        status = getattr(runner, "kv_scale_status", None)
        return {"kv_cache_dtype": "auto", "kv_scales": None} if status is None else status()

    def set_async_scheduling(self, enabled: bool | None) -> bool:
        """Turn overlap scheduling on or off (None: the device's default; the environment
        variable ``PAGEDCORE_ASYNC_SCHEDULING`` still overrides). A step in flight is
        finished first (its outputs are lost to the caller: switch between requests).
        Returns whether it is on; ``async_scheduling_reason`` says why not."""
        enabled = check_flag("enabled", enabled, allow_none=True)
        self.drain()
        self.async_scheduling, self.async_scheduling_reason = async_scheduling_setting(
            enabled, device_type=self.device.type)
        return self.async_scheduling

    def cudagraph_status(self) -> dict[str, Any]:
        """Whether decode steps replay CUDA graphs: ``{"enabled", "reason", "sizes",
        "capture_seconds", "step_paths", ...}`` (``reason`` says why not when disabled;
        ``step_paths`` counts the steps run so far by how they ran: ``"decode graph"``,
        ``"mixed graph"``, ``"eager (no bucket fits)"``, ... see
        `pagedcore.engine.runner.graph_routing.STEP_PATHS`)."""
        # With tensor parallelism: rank 0's runner (every rank captured the same graphs).
        runner: Any = getattr(self.runner, "local_runner", self.runner)
        graphs = getattr(runner, "graphs", None)
        paths = dict(sorted(getattr(runner, "step_paths", {}).items()))
        if graphs is None:
            reason = getattr(runner, "cudagraph_disabled_reason", None) or "not available"
            return {"enabled": False, "reason": reason, "sizes": [], "capture_seconds": 0.0,
                    "step_paths": paths}
        mixed = getattr(runner, "mixed_graphs", None)
        return {"enabled": True, "reason": None, "sizes": list(graphs.sizes),
                "step_paths": paths,
                "capture_seconds": graphs.capture_seconds,
                # Mixed/prefill steps (pagedcore.engine.runner.mixed_graphs): token buckets.
                "mixed_sizes": [] if mixed is None else list(mixed.sizes),
                "mixed_capture_seconds": 0.0 if mixed is None else mixed.capture_seconds,
                "mixed_reason": getattr(runner, "mixed_graphs_disabled_reason", None)}

    # ---- requests --------------------------------------------------------------------------

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        text, ids, _ = self._tokenize_packed(prompt)
        return text, ids

    def _tokenize_packed(self, prompt: PromptType) -> tuple[str | None, list[int], bytes | None]:
        return tokenize_packed(
            prompt, tokenizer=self.tokenizer, model_name=self.model_name,
            vocab_size=int(self.model.config.vocab_size),
            no_tokenizer_reason=self.no_tokenizer_reason,
        )

    def default_sampling_params(self) -> SamplingParams:
        """`SamplingParams()` with the fields the checkpoint's ``generation_config`` sets
        (`sampling_defaults`); what a request without params samples with."""
        return default_params(self.sampling_defaults)

    def _resolve(
        self, params: SamplingParams | None, num_prompt_tokens: int
    ) -> tuple[SamplingParams, dict[str, Any], list[list[int]]]:
        """Checked params (the defaults for None), the generation_config fields used, and
        the bad words as token ids; raises like `add_request`."""
        used: dict[str, Any] = {}
        if params is None:
            params, used = self.default_sampling_params(), dict(self.sampling_defaults)
        params = check_request(params, max_logprobs=self.max_logprobs, max_n=self.max_n,
                               vocab_size=int(self.model.config.vocab_size))
        params = resolve_max_tokens(params, num_prompt_tokens, self.max_model_len)
        self.scheduler.check_fits(num_prompt_tokens, params.max_tokens or 1)
        return params, used, bad_words_token_ids(params, self.tokenizer)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        delta: bool = False,
    ) -> None:
        """Queue a request for `step()`.

        Parameters
        ----------
        params:
            How to sample (None: `default_sampling_params`, from the checkpoint's
            ``generation_config``; the output's ``sampling_defaults`` lists what it took).
        delta:
            Its outputs hold only what is new since its previous output (as `LLM.stream`'s
            do); else each holds everything so far.

        Raises
        ------
        ValueError
            (nothing queued) A bad id, prompt or params, a request over the engine's bounds
            (``max_logprobs``, ``max_n``, ``max_model_len``, the KV cache), stop strings or
            bad words without a tokenizer, or an id already in use by this request or one
            of its samples.
        """
        check_flag("delta", delta)
        if params is not None:
            params = check_request(params, max_logprobs=self.max_logprobs, max_n=self.max_n)
        if not isinstance(request_id, str):
            raise InvalidArgumentTypeError(f"request_id must be a str, got {describe(request_id)}")
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        text, ids, packed = self._tokenize_packed(prompt)
        params, used, bad_words = self._resolve(params, len(ids))
        parent = ParentRequest(request_id, text, ids, sampling_defaults=used)
        parent.delta = delta
        children = make_children(
            parent, params, arrivals=self._arrivals, eos_token_ids=self.eos_token_ids,
            now=time.perf_counter(), tokenizer=self.tokenizer, bad_words_token_ids=bad_words,
            prompt_bytes=packed,
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
            if params.processes_logits:
                self._processing_ids.add(child.request_id)
            if child.needs_prompt_logprobs:
                self._prompt_pending[child.request_id] = child
        self._parents[request_id] = parent

    def abort(self, request_id: str) -> RequestOutput:
        """Stop a request (all its samples) and free its blocks; KeyError for an unknown id.

        Never raises otherwise: the final output is built even when the tokenizer fails.
        """
        if not isinstance(request_id, str):
            raise InvalidArgumentTypeError(
                f"request_id must be a str (the id given to add_request), got "
                f"{describe(request_id)}")
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
        for child in parent.children:  # (the overlap bookkeeping keeps nothing of it)
            self._processing_ids.discard(child.request_id)
            self._prompt_pending.pop(child.request_id, None)
        return self._output(parent)

    def has_unfinished_requests(self) -> bool:
        """True while a request can still run. Requests left with nothing that can run
        (only possible after an internal failure) are finished with an error here."""
        if self.scheduler.has_unfinished_requests():
            return True
        if self._parents:
            self._reap_orphans()
        return bool(self._parents)

    def step(
        self, *, finished_only: bool = False, deltas: list[tuple[Any, ...]] | None = None
    ) -> list[RequestOutput]:
        """Run one engine step; return the outputs of the requests that changed.

        With overlap scheduling (``async_scheduling``) a call launches the next step and
        returns what the step launched by the previous call produced: outputs arrive one
        call later, and the same tokens arrive as without overlap.

        Parameters
        ----------
        finished_only:
            Return (and build) only the outputs of requests that finished: an offline loop
            needs no others, and building one per running request per step costs host time.
        deltas:
            A list (a server's engine loop passes one per step): the outputs of requests added
            with ``delta=True`` that have one sample and no logprobs, prompt logprobs or
            error are appended to it as plain tuples of `DELTA_FIELDS`
            (`pagedcore.engine.output_builder.delta_fields`: the same tokens, text and finish
            reason as their `RequestOutput`) instead of being returned; the rest are returned
            as usual. Building hundreds of output objects per step is a share of the step's
            host time that a streaming server does not need. Filled even when the step raises
            `EngineStepError` (what was collected before the failure).

        Raises
        ------
        EngineStepError
            The model runner, a backend or the sampler raised. The step's requests (and their
            sibling samples) are finished with ``finish_reason == "error"``, their blocks
            freed, their outputs (tokens generated so far included) in ``.outputs``; the
            engine keeps serving everything else. A `TensorParallelError` (a rank failed: the
            engine is stopped) is raised as is, after finishing every request with an error.
        """
        check_flag("finished_only", finished_only)
        if deltas is None:
            return self._step(finished_only)
        if not isinstance(deltas, list):
            raise InvalidArgumentTypeError(
                f"deltas must be a list (the step appends its delta tuples to it) or None, got "
                f"{describe(deltas)}")
        self._delta_sink = deltas
        try:
            return self._step(finished_only)
        finally:
            self._delta_sink = None

    def _step(self, finished_only: bool) -> list[RequestOutput]:
        drained: list[RequestOutput] = []
        if self.async_scheduling:
            if not self._needs_current_tokens():
                return self._step_overlap(finished_only=finished_only)
            # Penalties, bad words and min_tokens read every token so far, which a step
            # launched one behind would not have (and prompt logprobs are brought to the host
            # in the step computing them): finish the step in flight, run this one without
            # overlap.
            drained = self.drain()
            self._prev_rows = self._prev_tokens = None
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
        forget, finished_values = self.sampler.forget, FINISHED_VALUES
        for request in changed:
            if request.status._value_ in finished_values:
                forget(request.request_id)
        outputs = self._end_step(changed, finished_only=finished_only, t0=t0,
                                 t_update=t_update)
        if self._processing_ids or self._prompt_pending:
            # Only the overlap path reads these; pruned here too, or with overlap off every
            # request with logits processors or prompt logprobs stayed referenced for the
            # engine's life.
            self._needs_current_tokens()
        return drained + outputs if drained else outputs

    def _needs_current_tokens(self) -> bool:
        """True while a live request's logits processors read its tokens, or its prompt
        logprobs are not all computed (see `step`)."""
        live = self._processing_ids
        if live:
            live.intersection_update(self._child_parent)
        pending = self._prompt_pending
        if pending:
            for done in [i for i, r in pending.items()
                         if r.status.finished or not r.needs_prompt_logprobs]:
                del pending[done]
        return bool(live or pending)

    def _end_step(
        self, changed: list[Request], *, finished_only: bool, t0: float, t_update: float
    ) -> list[RequestOutput]:
        """A step's outputs (`_collect_outputs`), its update time and count recorded."""
        outputs = self._collect_outputs(changed, finished_only=finished_only)
        # Each changed request received one token this step (a rejected one, rarely, none).
        self.num_generated_tokens += len(changed)
        if self._stats_logger is not None:
            self._stats_logger.maybe_log(self.stats, self.num_generated_tokens)
        t_end = time.perf_counter()
        self.phase_time["update"] += t_end - t_update
        self.step_time += t_end - t0
        self.num_steps += 1
        return outputs

    def _collect_outputs(
        self, changed: list[Request], *, finished_only: bool
    ) -> list[RequestOutput]:
        """The outputs of the user requests `changed` touched (with `finished_only`: of those
        whose every sample finished), after stopping those whose text matched a stop string
        (both step loops, the overlapped one included, end here)."""
        self._stop_on_strings(changed, now=time.perf_counter())
        if finished_only:
            done = self._parents_of([r for r in changed
                                     if r.status._value_ in FINISHED_VALUES]).values()
            parents = [p for p in done if all(c.status.finished for c in p.children)]
        else:
            parents = list(self._parents_of(changed).values())
        sink = self._delta_sink
        if sink is None:
            return self._outputs(parents)
        start = len(sink)
        rest = delta_fields([p for p in parents if p.delta], tokenizer=self.tokenizer,
                            errors=self.scheduler.errors, out=sink)
        outputs = self._outputs([p for p in parents if not p.delta])
        outputs += [self._output(p) for p in rest]
        pop_parent, pop_child = self._parents.pop, self._child_parent.pop
        for i in range(start, len(sink)):
            if sink[i][4] is not None:  # finished: it leaves the bookkeeping (as `_output`)
                parent = pop_parent(sink[i][0], None)
                if parent is not None:
                    pop_child(parent.children[0].request_id, None)
        return outputs

    def _stop_on_strings(self, changed: list[Request], *, now: float) -> None:
        """Detokenize the running requests with stop strings; stop those whose text matched."""
        stopped = []
        for request in changed:
            if not request.params.stop or request.status.finished:
                continue
            parent = self._child_parent.get(request.request_id)
            state = None if parent is None else parent.texts[request.sample_index]
            if state is None:
                continue
            advance_text(state, request._all_token_ids, offset=request._num_prompt_tokens)
            if state.stop_string is not None:
                request.stop_reason = state.stop_string
                stopped.append(request)
        if stopped:
            self.scheduler.stop(stopped, now=now)
            for request in stopped:
                self.sampler.forget(request.request_id)

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
        if inputs.prompt_rows is not None:
            num_sampled = int(inputs.logits_indices.shape[0])
            record_prompt_logprobs(inputs.prompt_rows, logits[num_sampled:])
            logits = logits[:num_sampled]
        rows = inputs.sample_rows
        if rows:
            requests = (rows.requests if isinstance(rows, DecodeBatch)
                        else [r.request for r in rows])
            ids = [r.request_id for r in requests]
            tokens, logprobs = self.sampler.sample(
                logits, [r.params for r in requests], ids, sequences=requests
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
