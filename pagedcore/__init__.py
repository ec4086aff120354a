"""pagedcore: a pluggable paged-attention framework for LLM inference.

Importing this package is cheap: it does not import triton, flash-attn or any compiled
extension, and never touches CUDA. Heavy pieces load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pagedcore.attention import (
    AttentionBackend,
    AttentionConfig,
    AttentionImpl,
    CommonAttentionMetadata,
    CudaGraphSupport,
    MetadataBuilder,
    MLAAttentionBackend,
    MultipleOf,
)
from pagedcore.plugins.hookspecs import hookimpl

__version__ = "0.1.0"

_LAZY = {
    # the plugin author's API: errors and warnings a backend or its user meets
    "PluginError": "pagedcore.plugins.errors",
    "BackendLoadError": "pagedcore.plugins.errors",
    "BackendSetupError": "pagedcore.plugins.errors",
    "BackendValidationError": "pagedcore.plugins.errors",
    "DuplicateBackendError": "pagedcore.plugins.errors",
    "UnknownBackendError": "pagedcore.plugins.errors",
    "PluginLoadWarning": "pagedcore.plugins.records",
    "ENTRY_POINT_GROUP": "pagedcore.plugins.hookspecs",
    # what a builder and an impl receive
    "AttentionImplOptions": "pagedcore.attention.backend",
    "KV_CACHE_DTYPES": "pagedcore.attention.backend",
    "split_decodes_and_prefills": "pagedcore.attention.metadata",
    "decode_first_order": "pagedcore.attention.metadata",
    "KVCacheSpec": "pagedcore.kv_cache.spec",
    "AttentionSpec": "pagedcore.kv_cache.spec",
    "FullAttentionSpec": "pagedcore.kv_cache.spec",
    "SlidingWindowSpec": "pagedcore.kv_cache.spec",
    "ChunkedLocalAttentionSpec": "pagedcore.kv_cache.spec",
    "MLAAttentionSpec": "pagedcore.kv_cache.spec",
    "select_backend": "pagedcore.plugins.selector",
    "explain_selection": "pagedcore.plugins.selector",
    "BackendSelectionError": "pagedcore.plugins.selector",
    "get_registry": "pagedcore.plugins.registry",
    "LLM": "pagedcore.engine.llm",
    "SamplingParams": "pagedcore.engine.sampling.sampling_params",
    "RequestOutput": "pagedcore.engine.outputs",
    "CompletionOutput": "pagedcore.engine.outputs",
    "Logprob": "pagedcore.engine.outputs",
    "ChatTemplateError": "pagedcore.engine.chat",
    # what a user's invalid argument raises (a ValueError; the type variant is also a TypeError)
    "InvalidArgumentError": "pagedcore.engine.validation",
    "InvalidArgumentTypeError": "pagedcore.engine.validation",
}

if TYPE_CHECKING:
    from pagedcore.attention.backend import KV_CACHE_DTYPES, AttentionImplOptions
    from pagedcore.attention.metadata import decode_first_order, split_decodes_and_prefills
    from pagedcore.engine.chat import ChatTemplateError
    from pagedcore.engine.llm import LLM
    from pagedcore.engine.outputs import CompletionOutput, Logprob, RequestOutput
    from pagedcore.engine.sampling.sampling_params import SamplingParams
    from pagedcore.engine.validation import InvalidArgumentError, InvalidArgumentTypeError
    from pagedcore.kv_cache.spec import (
        AttentionSpec,
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )
    from pagedcore.plugins.errors import (
        BackendLoadError,
        BackendSetupError,
        BackendValidationError,
        DuplicateBackendError,
        PluginError,
        UnknownBackendError,
    )
    from pagedcore.plugins.hookspecs import ENTRY_POINT_GROUP
    from pagedcore.plugins.records import PluginLoadWarning
    from pagedcore.plugins.registry import get_registry
    from pagedcore.plugins.selector import (
        BackendSelectionError,
        explain_selection,
        select_backend,
    )


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedcore' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "ENTRY_POINT_GROUP",
    "KV_CACHE_DTYPES",
    "LLM",
    "AttentionBackend",
    "AttentionConfig",
    "AttentionImpl",
    "AttentionImplOptions",
    "AttentionSpec",
    "BackendLoadError",
    "BackendSelectionError",
    "BackendSetupError",
    "BackendValidationError",
    "ChatTemplateError",
    "ChunkedLocalAttentionSpec",
    "CommonAttentionMetadata",
    "CompletionOutput",
    "CudaGraphSupport",
    "DuplicateBackendError",
    "FullAttentionSpec",
    "InvalidArgumentError",
    "InvalidArgumentTypeError",
    "KVCacheSpec",
    "Logprob",
    "MLAAttentionBackend",
    "MLAAttentionSpec",
    "MetadataBuilder",
    "MultipleOf",
    "PluginError",
    "PluginLoadWarning",
    "RequestOutput",
    "SamplingParams",
    "SlidingWindowSpec",
    "UnknownBackendError",
    "__version__",
    "decode_first_order",
    "explain_selection",
    "get_registry",
    "hookimpl",
    "select_backend",
    "split_decodes_and_prefills",
]
