"""The `pagedcore` command. Subcommands live in their own modules and load lazily."""

from __future__ import annotations

import importlib
import logging
import warnings
from typing import Any

import click

#: subcommand name -> "module:attribute" of a click command.
COMMANDS: dict[str, str] = {
    "backends": "pagedcore.plugins.cli:backends",
    "select": "pagedcore.plugins.cli:select",
    "conformance": "pagedcore.conformance.cli:conformance",
    "demo": "pagedcore.engine.cli:demo",
    "generate": "pagedcore.engine.cli:generate",
    "check-model": "pagedcore.engine.check_model_cli:check_model_command",
    "bench": "pagedcore.bench.cli:bench",
    "serve": "pagedcore.serve.cli:serve",
}


class LazyGroup(click.Group):
    """A click group whose subcommands are imported only when invoked."""

    def __init__(self, *args: Any, lazy: dict[str, str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = lazy

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = self.lazy.get(cmd_name)
        if target is None:
            return super().get_command(ctx, cmd_name)
        module_name, attr = target.split(":")
        command = getattr(importlib.import_module(module_name), attr)
        if not isinstance(command, click.Command):
            raise TypeError(f"{target} is not a click command")
        return command


@click.group(cls=LazyGroup, lazy=COMMANDS)
@click.version_option(package_name="pagedcore")
def main() -> None:
    """pagedcore: pluggable paged attention, a KV-cache manager and a batching engine."""
    from pagedcore.plugins.records import PluginLoadWarning

    # A broken plugin is listed by `pagedcore backends` (and logged once through `logging`,
    # shown where logging is configured), not repeated on the stderr of every command: no
    # warning, and a handler so that logging's last resort does not print the record.
    warnings.filterwarnings("ignore", category=PluginLoadWarning)
    logging.getLogger("pagedcore.plugins").addHandler(logging.NullHandler())


if __name__ == "__main__":
    main()
