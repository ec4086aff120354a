"""Which transformers architectures the engine can run, decided by what matters (no list).

The engine needs a decoder-only causal LM (``AutoModelForCausalLM``) whose attention layers call
transformers' `AttentionInterface` (the class declares ``_supports_attention_backend``) and whose
layout it can bind: ``<base model>.layers[i].self_attn`` with ``layer_idx`` and ``scaling`` (the
Llama layout most decoders share). `architecture_problems` returns every reason a config or a
model fails these, checked on a weightless (meta-device) instance, so a large checkpoint is
refused before its weights load. Parity with transformers is `pagedcore.engine.models.check_model`'s
job.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "UnsupportedModelError",
    "architecture_problems",
    "check_architecture",
    "output_logit_scale",
]


class UnsupportedModelError(ValueError):
    """A model the engine cannot run; the message says why."""


def _causal_lm_class(config: Any) -> tuple[Any, str | None]:
    """The ``AutoModelForCausalLM`` class of `config`, or (None, why not)."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM._model_mapping[type(config)], None
    except KeyError:
        pass
    auto_map = getattr(config, "auto_map", None) or {}
    if "AutoModelForCausalLM" in auto_map:
        return None, None  # remote code: judged on the instance
    return None, (
        f"transformers has no causal-LM class for model type "
        f"{getattr(config, 'model_type', None)!r} (AutoModelForCausalLM does not know it)"
    )


def _layout_problems(model: Any) -> list[str]:
    """Why the engine cannot bind `model`'s attention layers (empty: it can)."""
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    layers = getattr(base, "layers", None)
    if base is None or layers is None:
        prefix = getattr(model, "base_model_prefix", "?")
        found = [name for name, module in model.named_modules()
                 if name.endswith(".layers") and isinstance(module, _module_list_type())][:1]
        if found:
            return [
                f"module layout: {type(model).__name__} keeps its decoder layers at "
                f"{found[0]!r} but names {prefix!r} as its base model "
                "(base_model_prefix), through which the engine finds a model's layers"
            ]
        blocks = [name for name, _ in model.named_modules() if name.count(".") == 2][:1]
        seen = f" (its first block is {blocks[0]!r})" if blocks else ""
        return [
            f"module layout: the engine binds <base model>.layers[i].self_attn, but "
            f"{type(model).__name__} has no '{getattr(model, 'base_model_prefix', '?')}.layers'"
            f"{seen}; models laid out as GPT-2 (transformer.h[i].attn) cannot run"
        ]
    problems: list[str] = []
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        if attn is None:
            problems.append(
                f"module layout: layer {i} has no 'self_attn' (hybrid or recurrent layers "
                "have no paged KV cache here)"
            )
            break
        missing = [a for a in ("layer_idx", "scaling") if not hasattr(attn, a)]
        if missing:
            problems.append(
                f"module layout: layer {i}'s {type(attn).__name__} has no "
                f"{' / '.join(missing)}, which the engine needs to route its attention"
            )
            break
        if not _passes_kwargs_to_attention(type(layer)):
            problems.append(
                f"{type(layer).__name__}.forward calls self.self_attn(...) without passing its "
                "keyword arguments on, so the engine's step state cannot reach the attention "
                "(every step would fail)"
            )
            break
    return problems


def _module_list_type() -> type:
    """`torch.nn.ModuleList` (imported when a layout is checked)."""
    from torch import nn

    return nn.ModuleList


def _passes_kwargs_to_attention(layer_cls: type) -> bool:
    """False when the decoder layer's forward visibly calls ``self.self_attn(...)`` without
    ``**`` keyword arguments (the engine's step state travels in them); True when it passes
    them, or when its source cannot be read (no evidence either way)."""
    import inspect

    try:
        source = inspect.getsource(getattr(layer_cls, "forward", None))  # type: ignore[arg-type]
    except (OSError, TypeError):
        return True
    start = source.find("self.self_attn(")
    if start < 0:
        return True
    depth, end = 0, len(source)
    for pos in range(start + len("self.self_attn"), len(source)):
        depth += {"(": 1, ")": -1}.get(source[pos], 0)
        if depth == 0:
            end = pos
            break
    return "**" in source[start:end]


def _meta_instance(config: Any, trust_remote_code: bool) -> Any:
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            copy.deepcopy(config), trust_remote_code=trust_remote_code
        )


def architecture_problems(model: Any, *, trust_remote_code: bool = False) -> list[str]:
    """Every reason the engine cannot run `model` (a transformers config or model); empty
    when it can. A config is instantiated on the meta device (no weights, no memory)."""
    from transformers import PretrainedConfig

    config = model if isinstance(model, PretrainedConfig) else model.config
    if getattr(config, "is_encoder_decoder", False):
        return [f"{config.model_type!r} is an encoder-decoder model; the engine runs "
                "decoder-only causal LMs"]
    problems: list[str] = []
    if isinstance(model, PretrainedConfig):
        cls, why = _causal_lm_class(config)
        if why is not None:
            return [why]
        if cls is not None and not getattr(cls, "_supports_attention_backend", False):
            return [f"{cls.__name__}'s attention does not go through transformers' "
                    "AttentionInterface (it calls its own attention code), so pagedcore's "
                    "paged attention cannot be plugged in"]
        try:
            model = _meta_instance(config, trust_remote_code)
        except Exception as err:  # remote code, a config transformers cannot build...
            return [f"transformers cannot build {config.model_type!r} from its config "
                    f"({type(err).__name__}: {str(err)[:200]})"]
    elif not getattr(type(model), "_supports_attention_backend", False):
        return [f"{type(model).__name__}'s attention does not go through transformers' "
                "AttentionInterface, so pagedcore's paged attention cannot be plugged in"]
    problems += _layout_problems(model)
    return problems


def check_architecture(model: Any, *, trust_remote_code: bool = False) -> None:
    """Raise `UnsupportedModelError` with every reason `architecture_problems` finds."""
    problems = architecture_problems(model, trust_remote_code=trust_remote_code)
    if problems:
        from transformers import PretrainedConfig

        config = model if isinstance(model, PretrainedConfig) else model.config
        raise UnsupportedModelError(
            f"model type {getattr(config, 'model_type', None)!r} cannot run on the pagedcore "
            f"engine: {'; '.join(problems)}"
        )


def output_logit_scale(config: Any) -> float | None:
    """The factor a model's forward multiplies its ``lm_head`` output by (None: 1): Cohere's
    ``logit_scale``, Granite's ``1 / logits_scaling``."""
    scale = getattr(config, "logit_scale", None)
    if isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale != 1:
        return float(scale)
    divisor = getattr(config, "logits_scaling", None)
    if isinstance(divisor, (int, float)) and not isinstance(divisor, bool) and divisor != 1:
        return 1.0 / float(divisor)
    return None
