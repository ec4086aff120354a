"""Checks of the `LLM(...)` arguments, all before any model is loaded.

`check_engine_args` reports every bad argument at once, naming it, what was expected and what
to do; `check_device` turns a device argument into a ``torch.device`` the engine can use (an
unknown name, or CUDA asked for on a machine without it, is a clear error).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pagedcore.engine.validation import (
    MAX_SEED,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    Problems,
    check_bool,
    check_int,
    check_real,
    describe,
    raise_problems,
)

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_MAX_LOGPROBS", "DEFAULT_MAX_N", "check_device", "check_engine_args"]

#: Default cap on `SamplingParams.logprobs` (vLLM's default `max_logprobs`).
DEFAULT_MAX_LOGPROBS = 20
#: Default cap on `SamplingParams.n` (samples per prompt).
DEFAULT_MAX_N = 256

_POLICIES = ("fcfs", "priority")
_HASH_ALGOS = ("sha256", "xxhash")
_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


def check_device(device: Any) -> torch.device:
    """`device` as a ``torch.device``: None means CUDA when available, else the CPU.

    Raises
    ------
    InvalidArgumentError
        Not a CPU or CUDA device, an unparsable name, or CUDA (or a CUDA index) that this
        machine does not have.
    """
    import torch

    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise InvalidArgumentTypeError(
            f"invalid LLM argument: device must be None, 'cpu', 'cuda' or 'cuda:N', got "
            f"{describe(device)}"
        )
    try:
        resolved = torch.device(device)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise InvalidArgumentError(
            f"invalid LLM argument: device={device!r} is not a device name ({exc}); use None, "
            "'cpu', 'cuda' or 'cuda:N'"
        ) from None
    if resolved.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(
            f"invalid LLM argument: device={device!r} is not supported; pagedcore runs on "
            "'cpu' or 'cuda' ('cuda:N'), or pass None to pick CUDA when available"
        )
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidArgumentError(
                f"invalid LLM argument: device={device!r} was requested but CUDA is not "
                "available here (torch.cuda.is_available() is False: no GPU, or a CPU-only "
                "torch); use device='cpu', or None to pick CUDA only when available"
            )
        count = torch.cuda.device_count()
        if resolved.index is not None and resolved.index >= count:
            raise InvalidArgumentError(
                f"invalid LLM argument: device={device!r} but this machine has {count} CUDA "
                f"device(s) (cuda:0 to cuda:{count - 1}); pick one of those"
            )
    return resolved


def _check_buckets(p: Problems, name: str, value: Any) -> None:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        p.type(f"{name} must be a list of ints >= 1, got {describe(value)}")
        return
    for item in value:
        check_int(p, f"{name} element", item, low=1)


def check_engine_args(**args: Any) -> None:
    """Raise one `InvalidArgumentError` naming every bad `LLM(...)` argument in `args`.

    Only the arguments present are checked (the names are those of `LLM.__init__`).
    """
    p = Problems()
    ints = {
        "block_size": dict(low=1),
        "max_model_len": dict(low=1, allow_none=True),
        "max_num_seqs": dict(low=1),
        "max_num_batched_tokens": dict(low=1),
        "long_prefill_token_threshold": dict(low=1, allow_none=True),
        "kv_cache_memory_bytes": dict(low=1, allow_none=True,
                                      expected="an int > 0 (bytes) or None"),
        "seed": dict(low=0, high=MAX_SEED, expected="an int in [0, 2**64 - 1]"),
        "tensor_parallel_size": dict(low=1),
        "max_logprobs": dict(low=0),
        "max_n": dict(low=1),
    }
    for name, bounds in ints.items():
        if name in args:
            check_int(p, name, args[name], **bounds)  # type: ignore[arg-type]
    for name in ("enable_prefix_caching", "enable_chunked_prefill", "enforce_eager",
                 "trust_remote_code", "log_stats"):
        if name in args:
            check_bool(p, name, args[name])
    if "gpu_memory_utilization" in args:
        check_real(p, "gpu_memory_utilization", args["gpu_memory_utilization"], low=0.0,
                   low_open=True, high=1.0, expected="a float in (0, 1]")
    if "log_interval" in args:
        check_real(p, "log_interval", args["log_interval"], low=0.0, low_open=True,
                   expected="a number of seconds > 0")
    overlap = args.get("async_scheduling")
    if overlap is not None and not isinstance(overlap, bool):
        p.type(f"async_scheduling must be True, False or None (the device's default), got "
               f"{describe(overlap)}")
    kv_dtype = args.get("kv_cache_dtype", "auto")
    if not isinstance(kv_dtype, str) or kv_dtype not in _KV_CACHE_DTYPES:
        p.value(f"kv_cache_dtype must be one of {_KV_CACHE_DTYPES}, got {describe(kv_dtype)}")
    backend = args.get("backend")
    if backend is not None and not isinstance(backend, str):
        p.type(f"backend must be a backend name (str) or None, got {describe(backend)}")
    policy = args.get("scheduling_policy", "fcfs")
    if not isinstance(policy, str) or policy not in _POLICIES:
        p.value(f"scheduling_policy must be one of {_POLICIES}, got {describe(policy)}")
    algo = args.get("hash_algo", "sha256")
    if not isinstance(algo, str) or algo not in _HASH_ALGOS:
        p.value(f"hash_algo must be one of {_HASH_ALGOS}, got {describe(algo)}")
    seed = args.get("hash_seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, bytes))):
        p.type(f"hash_seed must be an int, bytes or None, got {describe(seed)}")
    kv = args.get("kv_cache_dtype", "auto")
    if not isinstance(kv, str) or kv.strip().lower() not in _KV_CACHE_DTYPES:
        p.value(f"kv_cache_dtype must be one of {_KV_CACHE_DTYPES}, got {describe(kv)}")
    tokenizer = args.get("tokenizer")
    if tokenizer is not None and not all(
        callable(getattr(tokenizer, m, None)) for m in ("encode", "decode")
    ):
        p.type(f"tokenizer must have encode() and decode() methods, got {describe(tokenizer)}")
    sizes = args.get("cudagraph_capture_sizes")
    if sizes is not None:
        _check_buckets(p, "cudagraph_capture_sizes", sizes)
    align = args.get("align_chunks_to_buckets", True)
    if not isinstance(align, bool):
        _check_buckets(p, "align_chunks_to_buckets (True, False or a list of ints)", align)
    raise_problems("LLM argument(s)", p)
