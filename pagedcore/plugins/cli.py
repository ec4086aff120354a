"""`pagedcore backends` (what is installed) and `pagedcore select` (explain a choice)."""

from __future__ import annotations

import itertools
import json
import sys
from typing import Any

import click
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from pagedcore.attention.backend import AttentionBackend
from pagedcore.plugins.records import RegisteredBackend
from pagedcore.plugins.registry import PLUGINS_ENV, BackendRegistry, get_registry
from pagedcore.plugins.selector import SelectionReport, describe_config, explain_selection
from pagedcore.plugins.validation import PluginCodeError, call_plugin_code, describe_error

__all__ = ["SCHEMA_VERSION", "backends", "select", "short_reason"]


#: Version of the ``backends --json`` record (docs/plugin-guide.md); bumped on a breaking change.
SCHEMA_VERSION = 1
_SHORT_REASON = 36
_SHORT_FAILURE = 60
_SHORT_DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


def _console(wide: bool = False) -> Console:
    # Piped output: 100 columns (what the short table is made for), 200 for the long form.
    return Console(width=None if sys.stdout.isatty() else (200 if wide else 100))


def _availability(cls: type[AttentionBackend]) -> str | None:
    try:
        return call_plugin_code("is_available()", cls.is_available)
    except PluginCodeError as err:
        return str(err)


def _features(cls: type[AttentionBackend]) -> list[str]:
    flags = {
        "sliding_window": cls.supports_sliding_window,
        "alibi": cls.supports_alibi,
        "soft_cap": cls.supports_logits_soft_cap,
        "sink": cls.supports_sink,
        "cascade": cls.supports_cascade,
        "cascade_graph": cls.supports_cascade_cudagraph,
        "cascade_mixed_graph": cls.supports_cascade_mixed_cudagraph,
        "mla_only" if cls.mla_only else "mla": cls.supports_mla or cls.mla_only,
    }
    names = [name for name, on in flags.items() if on]
    if cls.prefill_handoff:
        names.append(f"prefill:{cls.prefill_handoff}")
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
        "schema_version": SCHEMA_VERSION,
        "backends": [_backend_record(e) for e in entries],
        "failed_plugins": [
            {
                "plugin": f.plugin,
                "distribution": f.distribution,
                "version": f.version,
                "backend": f.backend,
                "error": describe_error(f.error),
                "message": f.message,
            }
            for f in registry.failures
        ],
        "excluded_plugins": list(registry.excluded),
    }


def short_reason(text: str, limit: int = _SHORT_REASON) -> str:
    """The first clause of a reason (up to ``;``), cut to `limit` characters."""
    first = text.split(";")[0].strip()
    return first if len(first) <= limit else first[: limit - 1].rstrip() + "\u2026"


def _dtype_short(names: list[str]) -> str:
    return ",".join(_SHORT_DTYPES.get(n, n) for n in names)


_SHORT_COLUMNS = ("name", "prio", "devices", "dtypes", "head sizes", "blocks", "features",
                  "available")
_LONG_COLUMNS = ("name", "distribution", "priority", "devices", "dtypes", "kv dtypes",
                 "head sizes", "block sizes", "features", "available")
_SHORT_FEATURES = {"sliding_window": "sw", "soft_cap": "cap"}


def _available_cell(why: str | None) -> str:
    return "[green]yes[/green]" if why is None else f"[yellow]no: {escape(why)}[/yellow]"


def _short_row(b: dict[str, Any]) -> list[str]:
    heads = b["head_sizes"]
    head_text = _compact_sizes(heads)
    if heads is not None and len(head_text) > 12:
        head_text = f"{heads[0]}..{heads[-1]} ({len(heads)})"
    features = [
        _SHORT_FEATURES.get(f, f.replace("cudagraph:", "graph:").replace(
            "uniform_single_token_decode", "decode").replace("uniform_batch", "uniform")
            .replace("prefill:", "pf:"))
        for f in b["features"]
    ]
    fp8 = [k.removeprefix("fp8_") for k in b.get("kv_cache_dtypes", ()) if k != "auto"]
    if fp8:  # the fp8 KV-cache formats served (the long form lists them under "kv dtypes")
        features.insert(0, "fp8:" + "/".join(fp8))
    why = b["unavailable_reason"]
    return [
        b["name"], str(b["priority"]), ",".join(b["devices"]), _dtype_short(b["dtypes"]),
        head_text, ",".join(b["block_sizes"]).replace("multiple of ", "k*"),
        ", ".join(features) or "-", _available_cell(None if why is None else short_reason(why)),
    ]


def _long_row(b: dict[str, Any]) -> list[str]:
    source = b["distribution"] or "<no distribution>"
    if b["version"]:
        source += f" {b['version']}"
    return [
        b["name"], source, str(b["priority"]), ", ".join(b["devices"]), ", ".join(b["dtypes"]),
        ", ".join(b["kv_cache_dtypes"]), _compact_sizes(b["head_sizes"]),
        ", ".join(b["block_sizes"]), ", ".join(b["features"]) or "-",
        _available_cell(b["unavailable_reason"]),
    ]


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON instead.")
@click.option("-v", "--verbose", is_flag=True,
              help="Every column and the full reasons (wider than 100 columns).")
def backends(as_json: bool, verbose: bool) -> None:
    """List registered attention backends, what they support, and plugins that failed.

    The table fits a 100-column terminal (short reasons); ``--verbose`` shows everything.
    ``--json`` prints the record documented in docs/plugin-guide.md (``schema_version`` 1).
    """
    record = _registry_record(get_registry())
    if as_json:
        click.echo(json.dumps(record, indent=2, default=str))
        return
    console = _console(verbose)
    table = Table(title="attention backends (lower priority wins)",
                  box=box.HEAVY_HEAD if verbose else box.SIMPLE_HEAD,
                  padding=(0, 1) if verbose else (0, 0), pad_edge=verbose)
    rows = [_long_row(b) if verbose else _short_row(b) for b in record["backends"]]
    for column in _LONG_COLUMNS if verbose else _SHORT_COLUMNS:
        table.add_column(column, no_wrap=column not in ("features", "available"))
    for row in rows:
        table.add_row(*row)
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
            message = f["message"] if verbose else short_reason(f["message"], _SHORT_FAILURE)
            failed.add_row(f["plugin"], source, f["backend"] or "-", escape(message))
        console.print(failed)
        if not verbose:
            console.print("(`pagedcore backends --verbose` shows the full messages)")
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
@click.option("--explain", is_flag=True,
              help="Also say why the backends that can serve it rank as they do: each one's "
                   "priority and the measurement that set it.")
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
    explain: bool,
) -> None:
    """Explain which attention backend serves a configuration, and why the others do not.

    Exits with status 1 and the reasons when no backend can serve it; with status 2 for a bad
    value or an unknown forced backend.
    """
    try:
        report = explain_selection(
            head_size=head_size, dtype=dtype, block_size=block_size,
            kv_cache_dtype=kv_cache_dtype, use_mla=mla, sliding_window=sliding_window,
            use_alibi=alibi, logits_soft_cap=soft_cap, device=device, backend=backend,
        )
    except ValueError as err:  # a bad value, or an unknown / failed forced backend
        cause = err.__cause__
        detail = f"; caused by {type(cause).__name__}: {cause}" if cause is not None else ""
        raise click.UsageError(f"{err}{detail}") from err
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        _print_report(report)
        if explain:
            click.echo(report.explain_order())
    if report.chosen is None:
        raise click.ClickException(report.error_message())
