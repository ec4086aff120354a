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
    "select_backend": "pagedcore.plugins.selector",
    "explain_selection": "pagedcore.plugins.selector",
    "BackendSelectionError": "pagedcore.plugins.selector",
    "get_registry": "pagedcore.plugins.registry",
    "LLM": "pagedcore.engine.llm",
    "SamplingParams": "pagedcore.engine.sampling_params",
    "RequestOutput": "pagedcore.engine.outputs",
}

if TYPE_CHECKING:
    from pagedcore.engine.llm import LLM
    from pagedcore.engine.outputs import RequestOutput
    from pagedcore.engine.sampling_params import SamplingParams
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
    "LLM",
    "AttentionBackend",
    "AttentionConfig",
    "AttentionImpl",
    "BackendSelectionError",
    "CommonAttentionMetadata",
    "CudaGraphSupport",
    "MLAAttentionBackend",
    "MetadataBuilder",
    "MultipleOf",
    "RequestOutput",
    "SamplingParams",
    "__version__",
    "explain_selection",
    "get_registry",
    "hookimpl",
    "select_backend",
]
