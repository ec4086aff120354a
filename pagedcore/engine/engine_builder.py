"""Wiring an engine: model, KV-cache config and manager, scheduler and model runner.

`build_engine` does what `LLM.__init__` needs before serving; `LLM` keeps only the request
bookkeeping and the step loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from pagedcore.engine.resources import default_kv_cache_bytes, resolve_device, resolve_dtype
from pagedcore.engine.scheduling.scheduler import Scheduler, SchedulerConfig

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from pagedcore.engine.distributed.executor import TensorParallelExecutor
    from pagedcore.engine.engine_args import EngineArgs
    from pagedcore.engine.runner.model_runner import ModelRunner
    from pagedcore.kv_cache.manager import KVCacheManager
    from pagedcore.kv_cache.spec import KVCacheConfig

__all__ = ["EngineParts", "build_engine"]


@attrs.frozen(kw_only=True)
class EngineParts:
    """Everything `build_engine` made, ready to serve."""

    device: torch.device
    dtype: torch.dtype
    model: PreTrainedModel
    model_name: str
    tokenizer: Any
    #: Why `tokenizer` is None (which files the checkpoint lacks); None when there is one.
    no_tokenizer_reason: str | None
    #: Every EOS id (generation config, model config, tokenizer).
    eos_token_ids: tuple[int, ...]
    #: `SamplingParams` fields the checkpoint's ``generation_config`` sets.
    sampling_defaults: dict[str, Any]
    max_model_len: int
    scheduler_config: SchedulerConfig
    kv_cache_config: KVCacheConfig
    kv_cache_manager: KVCacheManager
    scheduler: Scheduler
    runner: ModelRunner | TensorParallelExecutor


def _align_chunks(
    config: SchedulerConfig, runner: ModelRunner, align: bool | Sequence[int]
) -> SchedulerConfig:
    """`config` with ``token_buckets`` set as `align` asks: True: the captured mixed-step
    token buckets (unchanged when mixed steps run eagerly); False: off; a sequence: these
    buckets whether graphs run or not (tests)."""
    if align is False:
        return config
    if align is True:
        mixed = runner.mixed_graphs
        if mixed is None:
            return config
        buckets = tuple(sorted(mixed.sizes))
    else:
        buckets = tuple(sorted(int(b) for b in align))
    return attrs.evolve(config, token_buckets=buckets)


def build_engine(args: EngineArgs) -> EngineParts:
    """Load ``args.model`` and build its KV cache, scheduler and runner (`EngineArgs` says what
    each option means).

    Raises
    ------
    ValueError
        `max_model_len` beyond the model's ``max_position_embeddings``, a model that cannot
        be loaded, a KV-cache budget too small.
    """
    from pagedcore.engine.models.loading import load_model
    from pagedcore.engine.runner.model_runner import ModelRunner
    from pagedcore.kv_cache.config import kv_cache_specs_from_hf_config, make_kv_cache_config
    from pagedcore.kv_cache.manager import KVCacheManager

    model = args.model
    block_size, max_model_len = args.block_size, args.max_model_len
    max_num_seqs, max_num_batched_tokens = args.max_num_seqs, args.max_num_batched_tokens
    kv_cache_memory_bytes = args.kv_cache_memory_bytes
    gpu_memory_utilization = args.gpu_memory_utilization
    backend, seed, tensor_parallel_size = args.backend, args.seed, args.tensor_parallel_size
    cudagraph_capture_sizes = args.cudagraph_capture_sizes
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    kv_cache_dtype = args.resolved_kv_cache_dtype
    tp: TensorParallelExecutor | None = None
    if tensor_parallel_size != 1:
        from pagedcore.engine.distributed.executor import TensorParallelExecutor

        tp = TensorParallelExecutor(
            model, tensor_parallel_size=tensor_parallel_size, device=device,
            dtype=dtype, seed=seed, kv_cache_memory_bytes=kv_cache_memory_bytes,
            gpu_memory_utilization=gpu_memory_utilization,
            trust_remote_code=args.trust_remote_code,
        )
        device = tp.device
    try:
        loaded = load_model(model, dtype=dtype, device=device, seed=seed,
                            trust_remote_code=args.trust_remote_code)
        if tp is not None:
            tp.shard(loaded.model)
        config = loaded.model.config
        max_positions = int(config.max_position_embeddings)
        if max_model_len is None:
            max_model_len = max_positions
        elif max_model_len > max_positions:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                f"{max_positions}; lower max_model_len"
            )
        scheduler_config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=args.enable_chunked_prefill,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            policy=args.scheduling_policy,
        )
        rank_config = config if tp is None else tp.rank_config(config)
        from pagedcore.attention.kv_quant import kv_cache_torch_dtype

        kv_dtype = kv_cache_torch_dtype(kv_cache_dtype, dtype)  # block bytes follow it
        specs = kv_cache_specs_from_hf_config(rank_config, block_size=block_size, dtype=kv_dtype)
        if kv_cache_memory_bytes is None:
            kv_cache_memory_bytes = default_kv_cache_bytes(device, config, gpu_memory_utilization)
        if tp is not None:
            kv_cache_memory_bytes = tp.agree_kv_cache_bytes(kv_cache_memory_bytes)
        kv_cache_config = make_kv_cache_config(
            specs,
            memory_bytes=kv_cache_memory_bytes,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        kv_cache_manager = KVCacheManager(
            kv_cache_config, max_model_len, enable_caching=args.enable_prefix_caching,
            hash_algo=args.hash_algo, hash_seed=args.hash_seed,
        )
        scheduler = Scheduler(scheduler_config, kv_cache_manager, kv_cache_config)
        local = ModelRunner(
            loaded.model,
            kv_cache_config=kv_cache_config,
            device=device,
            dtype=dtype,
            backend=backend,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            num_heads=None if tp is None else int(rank_config.num_attention_heads),
            kv_cache_dtype=kv_cache_dtype,
            kv_scales=loaded.kv_scales,
        )
        if args.enforce_eager:
            local.cudagraph_disabled_reason = "enforce_eager=True"
        elif tp is None:
            local.enable_cudagraphs(sizes=cudagraph_capture_sizes)
        runner: ModelRunner | TensorParallelExecutor = local
        if tp is not None:
            # Every rank captures (in lockstep) once the workers have built their runners.
            runner = tp.attach(
                local, kv_cache_config=kv_cache_config, backend=backend,
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len, num_heads=int(rank_config.num_attention_heads),
                cudagraphs=not args.enforce_eager, cudagraph_capture_sizes=cudagraph_capture_sizes,
                kv_cache_dtype=kv_cache_dtype, kv_scales=loaded.kv_scales,
            )
        scheduler_config = _align_chunks(scheduler_config, local, args.align_chunks_to_buckets)
        scheduler.config = scheduler_config
        from pagedcore.engine.sampling.defaults import eos_token_ids, generation_defaults

        final_tokenizer = args.tokenizer if args.tokenizer is not None else loaded.tokenizer
        return EngineParts(
            device=device,
            dtype=dtype,
            model=loaded.model,
            model_name=loaded.name,
            tokenizer=final_tokenizer,
            no_tokenizer_reason=loaded.no_tokenizer_reason,
            eos_token_ids=eos_token_ids(loaded.model, final_tokenizer),
            sampling_defaults=generation_defaults(loaded.model),
            max_model_len=max_model_len,
            scheduler_config=scheduler_config,
            kv_cache_config=kv_cache_config,
            kv_cache_manager=kv_cache_manager,
            scheduler=scheduler,
            runner=runner,
        )
    except BaseException as exc:
        if tp is not None:
            # The workers wait in a setup collective: stop them, or the process cannot exit.
            tp.abort(f"engine setup failed on rank 0: {type(exc).__name__}: {exc}")
        raise
