"""`pagedcore check-model MODEL`: greedy parity of the engine with transformers, reported."""

from __future__ import annotations

import json

import click

from pagedcore.cli_types import OutputPath, positive_int
from pagedcore.engine.engine_args import EngineArgs
from pagedcore.engine.engine_args_cli import engine_options

__all__ = ["check_model_command"]


@click.command("check-model")
@engine_options(model="argument", only=("dtype", "device", "backend", "block_size", "seed",
                                        "trust_remote_code", "kv_cache_memory_bytes"))
@click.option("--num-tokens", default=8, show_default=True, type=positive_int(),
              help="Greedy tokens compared per prompt.")
@click.option("--json", "json_path", default=None, type=OutputPath(),
              help="Write the findings to this JSON file.")
def check_model_command(num_tokens: int, json_path: str | None,
                        engine_args: EngineArgs) -> None:
    """Check that MODEL (a checkpoint directory, a Hugging Face model id, 'demo' or
    'random:<type>') decodes greedily token for token as transformers does. Exit status 0:
    identical; 1: tokens differ; 2: the model cannot be loaded or run (the reason is given)."""
    import attrs

    from pagedcore.engine.models.check_model import check_model

    try:
        result = check_model(engine_args, num_tokens=num_tokens)
    except ValueError as exc:  # not found, unreadable checkpoint, KV budget: the user's
        raise click.UsageError(str(exc)) from exc
    if json_path:
        with open(json_path, "w") as fh:
            json.dump({**attrs.asdict(result), "passed": result.passed}, fh, indent=2)
            fh.write("\n")
    if result.problems:
        raise click.UsageError(result.summary())
    click.echo(result.summary())
    if not result.passed:
        raise SystemExit(1)
