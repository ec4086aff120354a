"""`pagedcore backends` (what is installed) and `pagedcore select` (explain a choice)."""

from __future__ import annotations

import itertools
import json
import sys
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from pagedcore.attention.backend import AttentionBackend
from pagedcore.plugins.records import RegisteredBackend
from pagedcore.plugins.registry import PLUGINS_ENV, BackendRegistry, get_registry
from pagedcore.plugins.selector import SelectionReport, describe_config, explain_selection

__all__ = ["backends", "select"]


def _console() -> Console:
    # Wide when piped, so tables stay one row per backend in logs and CI output.
    return Console(width=None if sys.stdout.isatty() else 200)


def _availability(cls: type[AttentionBackend]) -> str | None:
    try:
        return cls.is_available()
    except Exception as err:
        return f"is_available() raised {type(err).__name__}: {err}"


def _features(cls: type[AttentionBackend]) -> list[str]:
    flags = {
        "sliding_window": cls.supports_sliding_window,
        "alibi": cls.supports_alibi,
        "soft_cap": cls.supports_logits_soft_cap,
        "mla_only" if cls.mla_only else "mla": cls.supports_mla or cls.mla_only,
    }
    names = [name for name, on in flags.items() if on]
    if cls.cudagraph_support:
        names.append(f"cudagraph:{cls.cudagraph_support.name.lower()}")
    return names


def _compact_sizes(sizes: list[int] | None) -> str:
    """``"any"``, ``"64, 128"``, or ``"8..256 step 8"`` for long evenly spaced lists."""
    if sizes is None:
        return "any"
    steps = {b - a for a, b in itertools.pairwise(sizes)}
    if len(sizes) > 4 and len(steps) == 1:
        return f"{sizes[0]}..{sizes[-1]} step {steps.pop()}"
    return ", ".join(map(str, sizes))


def _backend_record(entry: RegisteredBackend) -> dict[str, Any]:
    cls = entry.cls
    heads = cls.supported_head_sizes
    return {
        "name": entry.name,
        "plugin": entry.plugin,
        "distribution": entry.distribution,
        "version": entry.version,
        "priority": cls.priority,
        "devices": list(cls.supported_devices),
        "dtypes": list(cls.supported_dtypes),
        "kv_cache_dtypes": list(cls.supported_kv_cache_dtypes),
        "head_sizes": None if heads is None else list(heads),
        "block_sizes": [str(b) for b in cls.supported_block_sizes],
        "features": _features(cls),
        "unavailable_reason": _availability(cls),
    }


def _registry_record(registry: BackendRegistry) -> dict[str, Any]:
    entries = sorted(registry.backends.values(), key=lambda e: (e.cls.priority, e.name))
    return {
        "backends": [_backend_record(e) for e in entries],
        "failed_plugins": [
            {
                "plugin": f.plugin,
                "distribution": f.distribution,
                "version": f.version,
                "backend": f.backend,
                "error": f"{type(f.error).__name__}: {f.error}",
                "message": f.message,
            }
            for f in registry.failures
        ],
        "excluded_plugins": list(registry.excluded),
    }


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON instead.")
def backends(as_json: bool) -> None:
    """List registered attention backends, what they support, and plugins that failed."""
    record = _registry_record(get_registry())
    if as_json:
        click.echo(json.dumps(record, indent=2))
        return
    console = _console()
    table = Table(title="attention backends (lower priority wins)")
    for column in ("name", "distribution", "priority", "devices", "dtypes", "kv dtypes",
                   "head sizes", "block sizes", "features", "available"):
        table.add_column(column)
    for b in record["backends"]:
        source = b["distribution"] or "<no distribution>"
        if b["version"]:
            source += f" {b['version']}"
        why = b["unavailable_reason"]
        table.add_row(
            b["name"], source, str(b["priority"]), ", ".join(b["devices"]),
            ", ".join(b["dtypes"]), ", ".join(b["kv_cache_dtypes"]),
            _compact_sizes(b["head_sizes"]),
            ", ".join(b["block_sizes"]), ", ".join(b["features"]) or "-",
            "[green]yes[/green]" if why is None else f"[yellow]no: {escape(why)}[/yellow]",
        )
    console.print(table)
    if not record["backends"]:
        console.print("[red]no backend is registered[/red]: install one, or check "
                      f"{PLUGINS_ENV}")
    if record["failed_plugins"]:
        failed = Table(title="plugins that failed to load (skipped)")
        for column in ("plugin", "distribution", "backend", "error"):
            failed.add_column(column)
        for f in record["failed_plugins"]:
            source = f"{f['distribution'] or '<no distribution>'} {f['version'] or ''}".strip()
            failed.add_row(f["plugin"], source, f["backend"] or "-", escape(f["message"]))
        console.print(failed)
    if record["excluded_plugins"]:
        console.print(f"not loaded ({PLUGINS_ENV}): {', '.join(record['excluded_plugins'])}")


def _print_report(report: SelectionReport) -> None:
    console = _console()
    table = Table(title=describe_config(report.config))
    for column in ("backend", "priority", "distribution", "verdict", "reasons"):
        table.add_column(column)
    for row in report.rows:
        verdict = (
            "[bold green]chosen[/bold green]" if row.chosen
            else "valid" if row.valid else "[red]rejected[/red]"
        )
        table.add_row(row.name, str(row.priority), row.source, verdict,
                      escape("; ".join(row.reasons)) or "-")
    console.print(table)
    if report.chosen is not None:
        forced = f" (forced by {report.forced_by})" if report.forced else ""
        console.print(f"chosen: [bold]{report.chosen}[/bold]{forced}")


@click.command()
@click.option("--head-size", type=int, required=True, help="Per-head dimension.")
@click.option("--dtype", default="bfloat16", show_default=True,
              help="Model dtype: float16, bfloat16, float32 (or fp16, bf16, fp32).")
@click.option("--block-size", type=int, default=16, show_default=True,
              help="Tokens per KV-cache block.")
@click.option("--kv-cache-dtype", default="auto", show_default=True,
              help="auto, fp8, fp8_e4m3 or fp8_e5m2.")
@click.option("--sliding-window", type=int, default=None, help="Sliding-window size W.")
@click.option("--mla", is_flag=True, help="Multi-head latent attention layers.")
@click.option("--alibi", is_flag=True, help="ALiBi position bias.")
@click.option("--soft-cap", type=float, default=None, help="Logits soft-cap c.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None,
              help="Default: cuda when available, else cpu.")
@click.option("--backend", default=None, help="Force this backend (no fallback).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def select(
    head_size: int,
    dtype: str,
    block_size: int,
    kv_cache_dtype: str,
    sliding_window: int | None,
    mla: bool,
    alibi: bool,
    soft_cap: float | None,
    device: str | None,
    backend: str | None,
    as_json: bool,
) -> None:
    """Explain which attention backend serves a configuration, and why the others do not.

    Exits with status 1 and the reasons when no backend can serve it.
    """
    try:
        report = explain_selection(
            head_size=head_size, dtype=dtype, block_size=block_size,
            kv_cache_dtype=kv_cache_dtype, use_mla=mla, sliding_window=sliding_window,
            use_alibi=alibi, logits_soft_cap=soft_cap, device=device, backend=backend,
        )
    except ValueError as err:
        cause = err.__cause__
        detail = f"\ncaused by {type(cause).__name__}: {cause}" if cause is not None else ""
        raise click.ClickException(f"{err}{detail}") from err
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        _print_report(report)
    if report.chosen is None:
        raise click.ClickException(report.error_message())
