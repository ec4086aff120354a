"""Click options generated from `EngineArgs`: every command that builds an engine gets the same
flags, defaults and help (the help text is the field's; vLLM's flag names).

`engine_options()` decorates a click command; the command receives ``engine_args`` (an
`EngineArgs`) or, for benchmarks that build several engines, ``engine_overrides`` (the fields
the user set on the command line, to apply to each engine the bench builds). A bad value is a
one-line usage error (exit code 2) before anything loads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping
from typing import Any, Literal, TypeVar

import attrs
import click
from click.core import ParameterSource

from pagedcore.cli_types import (
    BACKEND,
    DEVICE,
    FiniteFloat,
    IntList,
    MemorySize,
    positive_int,
)
from pagedcore.engine.engine_args import ENGINE_KV_CACHE_DTYPES, EngineArgs
from pagedcore.engine.validation import MAX_SEED

__all__ = [
    "CLI_OPTIONS",
    "DTYPE_CHOICES",
    "PYTHON_ONLY",
    "engine_options",
    "option_flags",
    "options_markdown",
]

F = TypeVar("F", bound=Callable[..., Any])

DTYPE_CHOICES = ("auto", "float32", "float16", "bfloat16", "fp32", "fp16", "bf16", "half",
                 "float")

#: field -> (flag declarations, extra click.option keywords). Help and default come from the
#: `EngineArgs` field. Order is the order of ``--help``.
CLI_OPTIONS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "dtype": (("--dtype",), dict(type=click.Choice(DTYPE_CHOICES))),
    "device": (("--device",), dict(type=DEVICE)),
    "backend": (("--backend",), dict(type=BACKEND)),
    "max_model_len": (("--max-model-len",), dict(type=positive_int())),
    "max_num_seqs": (("--max-num-seqs",), dict(type=positive_int())),
    "max_num_batched_tokens": (("--max-num-batched-tokens",), dict(type=positive_int())),
    "block_size": (("--block-size",), dict(type=positive_int())),
    "gpu_memory_utilization": (("--gpu-memory-utilization",),
                               dict(type=FiniteFloat(0.0, 1.0, min_open=True))),
    "kv_cache_memory_bytes": (("--kv-cache-memory", "--kv-cache-memory-bytes"),
                              dict(type=MemorySize())),
    "kv_cache_dtype": (("--kv-cache-dtype",), dict(type=click.Choice(ENGINE_KV_CACHE_DTYPES))),
    "enable_prefix_caching": (
        ("--enable-prefix-caching/--no-enable-prefix-caching", " /--no-prefix-caching"), {}),
    "enable_chunked_prefill": (
        ("--enable-chunked-prefill/--no-enable-chunked-prefill",), {}),
    "long_prefill_token_threshold": (("--long-prefill-token-threshold",),
                                     dict(type=positive_int())),
    "scheduling_policy": (("--scheduling-policy",),
                          dict(type=click.Choice(["fcfs", "priority"]))),
    "tensor_parallel_size": (("--tensor-parallel-size", "-tp"), dict(type=positive_int())),
    "seed": (("--seed",), dict(type=click.IntRange(0, MAX_SEED))),
    "trust_remote_code": (("--trust-remote-code",), dict(is_flag=True)),
    "enforce_eager": (("--enforce-eager",), dict(is_flag=True)),
    "async_scheduling": (("--async-scheduling/--no-async-scheduling",), {}),
    "cudagraph_capture_sizes": (("--cudagraph-capture-sizes",), dict(type=IntList(1))),
    "max_logprobs": (("--max-logprobs",), dict(type=positive_int(0))),
    "hash_algo": (("--prefix-caching-hash-algo",),
                  dict(type=click.Choice(["sha256", "xxhash"]))),
    "log_stats": (("--log-stats/--no-log-stats",), {}),
    "log_interval": (("--log-interval",), dict(type=FiniteFloat(0.0, min_open=True))),
}
#: Fields only Python callers set (objects, test knobs): no flag.
PYTHON_ONLY = frozenset({"model", "tokenizer", "align_chunks_to_buckets", "max_n", "hash_seed"})
#: Fields benches never take: they print their own tables (no periodic stats lines).
_NOT_IN_BENCHES = frozenset({"log_stats", "log_interval"})


def option_flags(name: str) -> tuple[str, ...]:
    """The command-line flags of `EngineArgs` field `name`."""
    return CLI_OPTIONS[name][0]


def _check_model(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """A checkpoint path is checked (exists, config.json, weights) before anything loads; a
    Hugging Face model id is resolved when the engine is built."""
    import os

    from pagedcore.engine.models.hub import looks_like_repo_id

    if value is None or value == "demo" or str(value).startswith("random:"):
        return value
    if not os.path.exists(value) and looks_like_repo_id(value):
        return value
    from pagedcore.engine.models.checkpoint import CheckpointError, check_checkpoint_dir

    try:
        check_checkpoint_dir(value)
    except CheckpointError as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from exc
    return value


def _model_param(kind: Literal["argument", "option"], help_text: str,
                 default: str) -> Callable[[F], F]:
    if kind == "argument":
        return click.argument("model", callback=_check_model)
    return click.option("--model", default=default, show_default=True, callback=_check_model,
                        help=help_text)


def engine_options(
    *,
    model: Literal["argument", "option"] | None = "option",
    exclude: Collection[str] = (),
    only: Collection[str] | None = None,
    defaults: Mapping[str, Any] | None = None,
    overrides: bool = False,
) -> Callable[[F], F]:
    """Add the engine's options to a click command.

    Parameters
    ----------
    model:
        ``"argument"``: a positional MODEL (as ``vllm serve``); ``"option"``: ``--model``
        (default ``demo``); None: the command picks its models itself.
    exclude:
        Fields the command does not offer (a bench that sweeps them).
    only:
        Offer just these fields (None: all but `exclude`).
    defaults:
        Command defaults that differ from `EngineArgs`' (``model`` for ``--model``).
    overrides:
        False: the command gets ``engine_args`` (an `EngineArgs`). True (benches): it gets
        ``engine_overrides``, a dict of only the fields set on the command line (validated).
    """
    skipped = set(exclude) | (_NOT_IN_BENCHES if overrides else set())
    names = [n for n in CLI_OPTIONS if n not in skipped and (only is None or n in only)]
    fields = attrs.fields_dict(EngineArgs)
    own_defaults = dict(defaults or {})
    if "log_stats" in names:
        own_defaults.setdefault("log_stats", True)  # on in the CLI, off in the library

    def decorate(func: F) -> F:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            ctx = click.get_current_context()
            values = {n: kwargs.pop(n) for n in names}
            if model is not None:
                values["model"] = kwargs.pop("model")
            if values.get("cudagraph_capture_sizes") is not None:
                values["cudagraph_capture_sizes"] = tuple(values["cudagraph_capture_sizes"])
            try:
                engine_args = EngineArgs(**values)
            except ValueError as exc:  # InvalidArgumentError: the user's
                raise click.UsageError(str(exc)) from exc
            if overrides:
                kwargs["engine_overrides"] = {
                    n: getattr(engine_args, n) for n in names
                    if ctx.get_parameter_source(n) is not ParameterSource.DEFAULT
                }
            else:
                kwargs["engine_args"] = engine_args
            return func(*args, **kwargs)

        decorated: Any = wrapper
        for name in reversed(names):
            decls, extra = CLI_OPTIONS[name]
            field = fields[name]
            default = own_defaults.get(name, field.default)
            show = default is not None and not extra.get("is_flag")
            decorated = click.option(
                *decls, name, default=default, show_default=show,
                help=str(field.metadata["help"]), **extra,
            )(decorated)
        if model is not None:
            decorated = _model_param(model, str(fields["model"].metadata["help"]),
                                     str(own_defaults.get("model", "demo")))(decorated)
        result: F = decorated
        return result

    return decorate


def options_markdown() -> str:
    """The table of every `EngineArgs` field (flag, default, help) for docs/engine-args.md."""
    rows = ["| `LLM(...)` / `EngineArgs` field | flag | default | what |",
            "| --- | --- | --- | --- |"]
    for name, field in attrs.fields_dict(EngineArgs).items():
        if name == "model":
            flags = "`MODEL` (serve, check-model) / `--model` (generate, bench tp)"
        elif name in CLI_OPTIONS:
            flags = ", ".join(f"`{d.strip()}`" for d in option_flags(name))
        else:
            flags = "(Python only)"
        default = "" if field.default is None else f"`{field.default!r}`"
        rows.append(f"| `{name}` | {flags} | {default} | {field.metadata['help']} |")
    return "\n".join(rows) + "\n"
