"""Prefill-heavy steps handed to triton's Hopper prefill kernel (issue #26, cuda_paged prefill).

cuda_paged's own prefill (``csrc/prefill_mma.cuh``) reaches 0.36x / 0.41x torch SDPA's TFLOP/s
on the H200 at 4x2048 / 4x8192 (``docs/benchmarks/cuda_paged.md``); the triton backend's
Hopper kernel (``pagedcore_triton/kernels/prefill_tma.py``, TMA loads, wgmma tiles) is faster.
The two caches have different layouts (cuda_paged keeps 16-byte vectors of head dims per key,
triton a ``[block, slot, head, dim]`` array), so the Hopper kernel cannot read cuda_paged's
cache, but it does not need to for a prompt with no cached context: it reads such a prompt's
keys and values from this step's ``key`` / ``value`` tensors. So the metadata builder hands
those requests (query length > 1, nothing cached before them: ``seq_len == query_len``) to
it, one launch per contiguous run of them; prefills over a cached context (chunked-prefill
continuations, prefix-cache hits) and decodes stay on cuda_paged's kernels. A layer the Hopper
kernel does not serve (ALiBi, sliding window, soft-cap, float32, key/value not laid out for
TMA: `pagedcore_triton.plan_tma.tma_layer_reason`) runs cuda_paged's prefill for them.

``PAGEDCORE_CUDA_PAGED_PREFILL``: ``auto`` (default: hand off where the triton backend is
installed, the device is compute capability 9.x and the head size is 64 or 128), ``own``
(never) or ``triton`` (wherever the triton backend is installed, whatever the device: tests
in Triton's interpreter).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from pagedcore.kv_cache.spec import AttentionSpec

__all__ = ["PREFILL_ENV", "handoff_reason", "handoff_runs"]

#: ``auto`` | ``own`` | ``triton`` (see the module docstring).
PREFILL_ENV = "PAGEDCORE_CUDA_PAGED_PREFILL"
_CHOICES = ("auto", "own", "triton")


def prefill_choice() -> str:
    """``PAGEDCORE_CUDA_PAGED_PREFILL`` (``auto`` when unset); a ValueError names the values."""
    choice = os.environ.get(PREFILL_ENV, "auto").strip().lower() or "auto"
    if choice not in _CHOICES:
        raise ValueError(
            f"{PREFILL_ENV}={choice!r} is not one of {', '.join(_CHOICES)}; unset it or pick one"
        )
    return choice


def handoff_reason(spec: AttentionSpec, device: torch.device) -> str | None:
    """None when this KV-cache group's context-free prefills go to triton's Hopper kernel,
    else why not (for the capability table and the tests)."""
    choice = prefill_choice()
    if choice == "own":
        return f"{PREFILL_ENV}=own"
    if importlib.util.find_spec("pagedcore_triton") is None:
        return "the triton backend (pagedcore-triton) is not installed"
    from pagedcore_triton.plan_tma import TMA_HEAD_SIZES, tma_prefill_spec

    if not tma_prefill_spec(spec.head_size):
        return f"head size {spec.head_size} (the Hopper kernel serves {TMA_HEAD_SIZES})"
    if spec.dtype not in ("float16", "bfloat16") and choice != "triton":
        return f"{spec.dtype} (the Hopper kernel runs 16-bit dtypes)"
    if choice == "triton":
        return None
    if device.type != "cuda":
        return f"device {device} (the Hopper kernel needs CUDA compute capability 9.x)"
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"compute capability {major}.{minor} (the Hopper kernel needs 9.x)"
    return None


def handoff_runs(query_lens: Sequence[int], seq_lens: Sequence[int]) -> list[tuple[int, int]]:
    """Maximal runs ``[begin, end)`` of consecutive requests that are prompts with nothing
    cached before them (``query_len > 1`` and ``seq_len == query_len``)."""
    runs: list[tuple[int, int]] = []
    begin = None
    for i, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
        fresh = q > 1 and s == q
        if fresh and begin is None:
            begin = i
        elif not fresh and begin is not None:
            runs.append((begin, i))
            begin = None
    if begin is not None:
        runs.append((begin, len(query_lens)))
    return runs


def launch_parts(
    runs: Sequence[tuple[int, int]], query_start_loc_cpu: Sequence[int], query_lens: Sequence[int]
) -> tuple[Any, ...]:
    """One triton `LaunchPart` per run (prefill-only, no cached context, Hopper kernel)."""
    from pagedcore_triton.plan import LaunchPart

    return tuple(
        LaunchPart(
            req_begin=a, req_end=b, token_begin=int(query_start_loc_cpu[a]),
            token_end=int(query_start_loc_cpu[b]), max_query_len=max(query_lens[a:b]),
            prefill_only=True, tma_prefill=True, has_context=False,
        )
        for a, b in runs
    )
