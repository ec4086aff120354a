"""Issue #25 item 6: every option of every `pagedcore` command has help text; the commands that
build an engine share its options (generated from `EngineArgs`, vLLM's names)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import click
import pytest
from click.testing import CliRunner

from pagedcore.cli import main
from pagedcore.engine.engine_args import engine_arg_help
from pagedcore.engine.engine_args_cli import CLI_OPTIONS, PYTHON_ONLY


def _commands(group: click.Group, path: tuple[str, ...] = ()) -> Iterator[
        tuple[tuple[str, ...], click.Command]]:
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        assert command is not None, name
        yield (*path, name), command
        if isinstance(command, click.Group):
            yield from _commands(command, (*path, name))


ALL = dict(_commands(main))
ENGINE_COMMANDS = {("generate",): "option", ("serve",): "argument", ("bench", "tp"): "option",
                   ("bench", "engine"): None, ("bench", "prefix"): None,
                   ("bench", "chunked"): None, ("bench", "step"): None}
#: Flags a command leaves out on purpose (bench step sets the batch size per row itself).
ENGINE_EXCLUDED = {("bench", "step"): {"--max-num-seqs"}}
VLLM_FLAGS = ["--max-model-len", "--max-num-seqs", "--gpu-memory-utilization",
              "--kv-cache-memory", "--kv-cache-dtype", "--block-size", "--dtype", "--device",
              "--backend", "--seed", "--trust-remote-code"]


def test_every_option_of_every_command_has_help() -> None:
    assert len(ALL) > 15
    missing = [f"pagedcore {' '.join(path)} {param.opts[0]}"
               for path, command in ALL.items() for param in command.params
               if isinstance(param, click.Option) and not (param.help or "").strip()]
    assert not missing, f"options without help text: {missing}"


def test_every_engine_field_is_a_flag_or_python_only() -> None:
    from attrs import fields_dict

    from pagedcore.engine.engine_args import EngineArgs

    assert set(fields_dict(EngineArgs)) == set(CLI_OPTIONS) | PYTHON_ONLY


@pytest.mark.parametrize("path", list(ENGINE_COMMANDS), ids=" ".join)
def test_engine_commands_share_the_engine_options(path: tuple[str, ...]) -> None:
    command = ALL[path]
    options = {opt: p for p in command.params for opt in [*p.opts, *p.secondary_opts]}
    for flag in [f for f in VLLM_FLAGS if f not in ENGINE_EXCLUDED.get(path, ())]:
        assert options[flag].help == engine_arg_help(
            next(n for n, (decls, _) in CLI_OPTIONS.items() if flag in decls[0].split("/"))
        ), (path, flag)
    kind = ENGINE_COMMANDS[path]
    model = [p for p in command.params if p.name == "model"]
    if kind is None:
        assert not model or model[0].opts != ["model"]
    else:
        assert isinstance(model[0], click.Argument if kind == "argument" else click.Option)
    if path == ("serve",):
        assert {"--no-prefix-caching", "--no-enable-prefix-caching",
                "--enable-prefix-caching", "-tp", "--tensor-parallel-size"} <= set(options)


def test_no_prefix_caching_alias_and_memory_sizes() -> None:
    seen: dict[str, object] = {}

    @click.command()
    @click.pass_context
    def probe(ctx: click.Context) -> None:
        seen.update(ctx.params)

    from pagedcore.engine.engine_args_cli import engine_options

    @click.command()
    @engine_options(model="argument")
    def cmd(engine_args: object) -> None:
        seen["args"] = engine_args

    result = CliRunner().invoke(cmd, ["demo", "--no-prefix-caching", "--kv-cache-memory",
                                      "8MiB", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    args = seen["args"]
    assert args.enable_prefix_caching is False  # type: ignore[attr-defined]
    assert args.kv_cache_memory_bytes == 8 * 2**20  # type: ignore[attr-defined]
    assert args.log_stats is True  # type: ignore[attr-defined]  # on in the CLI


def test_python_dash_m_pagedcore() -> None:
    out = subprocess.run([sys.executable, "-m", "pagedcore", "--help"], capture_output=True,
                         text=True, check=True).stdout
    assert "generate" in out and "serve" in out


def test_docs_table_is_current() -> None:
    from pathlib import Path

    from pagedcore.engine.engine_args_cli import options_markdown

    doc = Path(__file__).resolve().parents[2] / "docs" / "engine-args.md"
    assert options_markdown() in doc.read_text(), (
        "docs/engine-args.md is stale: paste pagedcore.engine.engine_args_cli.options_markdown()")


def test_every_bench_shows_a_progress_bar() -> None:
    """#25 item 7: each `pagedcore bench` command's module drives a progress bar (the shared
    `cli_progress.progress_bar`, or rich's `Progress` for the load generator)."""
    import inspect
    import sys

    benches = {path: cmd for path, cmd in ALL.items() if path[0] == "bench" and len(path) == 2}
    assert len(benches) >= 10
    missing = []
    for path, command in benches.items():
        source = inspect.getsource(sys.modules[command.callback.__module__])  # type: ignore[union-attr]
        if "progress_bar(" not in source and "Progress(" not in source:
            missing.append(" ".join(path))
    assert not missing, missing
