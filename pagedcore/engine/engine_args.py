"""`EngineArgs`: every engine option in one place, named as vLLM names them.

`LLM(...)` keeps its keyword signature and builds an `EngineArgs` from it; the CLI commands
(`pagedcore generate`, `pagedcore serve`, the benches that build an engine) get their options
and help generated from the fields here (`pagedcore.engine.engine_args_cli.engine_options`).
Each field carries its help text in ``metadata["help"]``. Construction validates every field
at once (`pagedcore.engine.arguments.check_engine_args`), before anything loads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import attrs

from pagedcore.engine.arguments import DEFAULT_MAX_LOGPROBS, DEFAULT_MAX_N, check_engine_args

__all__ = ["ENGINE_KV_CACHE_DTYPES", "EngineArgs", "engine_arg_help"]

#: What ``kv_cache_dtype`` accepts ("fp8" means "fp8_e4m3"); whether the selected backend
#: supports it is the selector's question, not this class's.
ENGINE_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


def _arg(default: Any, help: str, **kw: Any) -> Any:
    """An `EngineArgs` field with its help text (the CLI shows it, the docs table lists it)."""
    return attrs.field(default=default, metadata={"help": help}, **kw)


@attrs.frozen(kw_only=True)
class EngineArgs:
    """Every option of the engine, validated at construction.

    Raises
    ------
    InvalidArgumentError
        (a ValueError; also a TypeError for a wrong type) naming every bad field at once.

    Examples
    --------
    >>> args = EngineArgs(model="demo", max_model_len=256, device="cpu")
    >>> args.max_num_seqs
    256
    """

    model: Any = _arg(
        "demo",
        "A local checkpoint directory, a Hugging Face model id (from the local cache; "
        "downloaded when the hub is reachable), 'demo' or 'random:<type>'.",
        eq=False,
    )
    tokenizer: Any = _arg(None, "Overrides the model's tokenizer (encode/decode).", eq=False)
    trust_remote_code: bool = _arg(
        False, "Allow a checkpoint's own Python code (config/model classes) to run.")
    dtype: Any = _arg(
        None, "Model dtype: auto, bfloat16, float16 or float32 (auto: bfloat16 on CUDA, "
        "float32 on the CPU).")
    device: Any = _arg(None, "cpu, cuda or cuda:N (default: cuda when available).")
    seed: int = _arg(0, "Seed of random weights and of sampling without a per-request seed.")
    block_size: int = _arg(16, "Tokens per KV-cache block.")
    max_model_len: int | None = _arg(
        None, "Longest prompt + output in tokens (default: the model's "
        "max_position_embeddings).")
    max_num_seqs: int = _arg(256, "Requests per engine step at most.")
    max_num_batched_tokens: int = _arg(2048, "Tokens per engine step at most.")
    enable_prefix_caching: bool = _arg(True, "Reuse KV blocks of shared prompt prefixes.")
    enable_chunked_prefill: bool = _arg(True, "Split long prompts across engine steps.")
    long_prefill_token_threshold: int | None = _arg(
        None, "Cap one request's prefill tokens per step (default: no cap).")
    kv_cache_memory_bytes: int | None = _arg(
        None, "KV-cache budget in bytes (overrides gpu_memory_utilization; default: 64 MiB "
        "on the CPU).")
    gpu_memory_utilization: float = _arg(
        0.9, "Fraction of the GPU pagedcore may fill (without a KV-cache budget).")
    kv_cache_dtype: str = _arg(
        "auto", "KV-cache element type: auto (the model dtype), fp8 (= fp8_e4m3), fp8_e4m3 "
        "or fp8_e5m2.")
    backend: str | None = _arg(
        None, "Force an attention backend by name, with no fallback (default: the selector "
        "picks).")
    scheduling_policy: Literal["fcfs", "priority"] = _arg(
        "fcfs", "fcfs (arrival order) or priority (SamplingParams priority first).")
    tensor_parallel_size: int = _arg(
        1, "Shard attention heads and the MLP over this many processes (docs/distributed.md).")
    enforce_eager: bool = _arg(False, "Never use CUDA graphs.")
    cudagraph_capture_sizes: Sequence[int] | None = _arg(
        None, "Batch-size buckets of decode CUDA graphs (default: 1, 2, 4, 8, 16, 24, ... up "
        "to max_num_seqs).")
    align_chunks_to_buckets: bool | Sequence[int] = _arg(
        True, "Shrink a partial prefill chunk so a mixed step fills a captured token bucket "
        "(a list: align to those buckets).")
    max_logprobs: int = _arg(
        DEFAULT_MAX_LOGPROBS, "Largest SamplingParams.logprobs a request may ask for.")
    max_n: int = _arg(DEFAULT_MAX_N, "Largest SamplingParams.n (samples per prompt).")
    hash_algo: str = _arg("sha256", "Prefix-cache block hash: sha256 or xxhash.")
    hash_seed: bytes | int | None = _arg(
        None, "Seed of the prefix-cache hash chain (default: random per process).")
    log_stats: bool = _arg(
        False, "Log a stats line (running, waiting, KV usage, prefix hits, throughput) "
        "through logger 'pagedcore.engine' (on in the CLI, off in the library).")
    log_interval: float = _arg(10.0, "Seconds between stats lines.")
    async_scheduling: bool | None = _arg(
        None, "Overlap scheduling: prepare step N+1 while step N runs on the device (default: "
        "on with CUDA, off on the CPU; PAGEDCORE_ASYNC_SCHEDULING=0/1 overrides).")

    def __attrs_post_init__(self) -> None:
        values = attrs.asdict(self, recurse=False)
        for name in ("model", "dtype", "device"):  # checked where they are resolved
            del values[name]
        check_engine_args(**values)

    @property
    def resolved_kv_cache_dtype(self) -> str:
        """`kv_cache_dtype` with the "fp8" alias spelled out (``"fp8_e4m3"``)."""
        return "fp8_e4m3" if self.kv_cache_dtype == "fp8" else self.kv_cache_dtype


def engine_arg_help(name: str) -> str:
    """The help text of `EngineArgs` field `name`."""
    return str(attrs.fields_dict(EngineArgs)[name].metadata["help"])
