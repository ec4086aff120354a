"""What a checkpoint says about sampling and stopping: its EOS ids and ``generation_config``.

Instruct models ship several end ids (Llama 3: ``<|end_of_text|>`` and ``<|eot_id|>``, as
``generation_config.eos_token_id = [...]``); every one of them, the model config's and the
tokenizer's EOS stop a request. The sampling fields a checkpoint's ``generation_config.json``
sets explicitly become the defaults of requests that give no `SamplingParams` (as vLLM's
``generation_config="auto"`` does).
"""

from __future__ import annotations

from typing import Any

from pagedcore.engine.validation import as_index

__all__ = ["GENERATION_CONFIG_FIELDS", "eos_token_ids", "generation_defaults"]

#: ``generation_config`` field -> `SamplingParams` field, for the fields taken as defaults.
GENERATION_CONFIG_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def _ids(value: Any, where: str) -> list[int]:
    values = [] if value is None else value if isinstance(value, (list, tuple)) else [value]
    out = []
    for v in values:
        if v is None:
            continue
        as_int = as_index(v)
        if as_int is None or as_int < 0:
            raise ValueError(
                f"{where} eos_token_id must be a token id (an int >= 0) or a list of them, got "
                f"{value!r}; fix that field of the checkpoint")
        out.append(as_int)
    return out


def eos_token_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    """Every EOS id: ``generation_config.eos_token_id`` (an int or a list), the model config's
    and the tokenizer's ``eos_token_id``, in that order, without repeats.

    Raises
    ------
    ValueError
        One of them is not a token id (naming the file it comes from).
    """
    found: list[int] = []
    generation = getattr(model, "generation_config", None)
    found += _ids(getattr(generation, "eos_token_id", None), "generation_config.json's")
    found += _ids(getattr(getattr(model, "config", None), "eos_token_id", None),
                  "config.json's")
    found += _ids(getattr(tokenizer, "eos_token_id", None), "the tokenizer's")
    return tuple(dict.fromkeys(found))


def generation_defaults(model: Any) -> dict[str, Any]:
    """The `SamplingParams` fields the model's ``generation_config`` sets explicitly.

    Only values that differ from transformers' own defaults count (a config built from a model
    config alone sets none). A ``generation_config`` that says ``do_sample=False`` makes the
    default greedy (temperature 0), as transformers' ``generate()`` would be.
    """
    generation = getattr(model, "generation_config", None)
    if generation is None or not hasattr(generation, "to_diff_dict"):
        return {}
    try:
        given = generation.to_diff_dict()
    except Exception:  # a hand-made config transformers cannot diff: take nothing from it
        return {}
    out: dict[str, Any] = {}
    for source, target in GENERATION_CONFIG_FIELDS.items():
        value = given.get(source)
        if value is not None:
            out[target] = value
    if given.get("do_sample") is False:
        out["temperature"] = 0.0
        for key in ("top_p", "top_k", "min_p"):
            out.pop(key, None)
    return out
