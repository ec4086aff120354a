"""`pagedcore bench backends`: decode bandwidth and prefill TFLOP/s of every backend, one plot.

Two sources of figures:

- live (default): `pagedcore.bench.kernels`' own measuring functions (`bench_uniform`) on its
  decode and prefill shapes (``--small``: its quick shapes, also on CPU) for every installed
  backend that accepts the configuration, plus torch SDPA on a contiguous cache as the ceiling,
  at 32 query / 8 KV heads of 128 or the ``--heads`` / ``--head-size`` given;
- ``--from-json PATH`` (repeatable): committed kernel reports. Understood layouts: the
  ``results`` rows of ``pagedcore bench kernels --json``, a ``shipped_configuration`` list
  (docs/benchmarks/triton_h200.json) and per-case ``decode`` / ``prefill`` lists with
  ``batch``/``ctx``/``len`` and ``gbps``/``tflops`` (docs/benchmarks/cuda_paged_h200.json).
  Where a report holds several variants of one backend for one shape, the ``auto`` variant (the
  shipped dispatch) is kept, else the fastest, and the variant is named in the row.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import click

from pagedcore.bench.kernel_primitives import DEFAULT_HEADS, HeadShape
from pagedcore.bench.kernels import head_options, parse_heads
from pagedcore.cli_progress import progress_bar
from pagedcore.cli_types import BACKEND, OutputPath

__all__ = ["backends", "heads_label", "normalize_report", "report_heads"]

_SDPA = "torch SDPA (contiguous)"


def _impl_name(impl: str, default: str) -> tuple[str, str | None]:
    """(backend, variant) of an implementation label."""
    low = impl.lower()
    if low.startswith("sdpa"):
        return _SDPA, None
    if "/" in impl:
        head, variant = impl.split("/", 1)
        return head, variant
    if impl in ("two_lanes_per_row", "lane_per_key"):  # cuda_paged prefill variants
        return default, impl
    return impl, None


def normalize_report(data: dict[str, Any], *, source: str) -> list[dict[str, Any]]:
    """Rows ``{backend, variant, case, shape, GBps | TFLOPs, ms, source}`` of one kernel report.

    `source` is the report's file name; its stem before ``_`` names the backend of rows whose
    implementation label does not (``two_lanes_per_row`` and the like).
    """
    default = os.path.basename(source).split("_h200")[0].split(".")[0]
    raw: list[dict[str, Any]] = []
    if isinstance(data.get("shipped_configuration"), list):
        raw = [{**r, "impl": r.get("impl", default)} for r in data["shipped_configuration"]]
    elif isinstance(data.get("results"), list):
        raw = list(data["results"])
    else:
        for part in ("decode", "prefill"):
            if isinstance(data.get(part), list):
                raw += [r for r in data[part] if isinstance(r, dict)]
    rows: list[dict[str, Any]] = []
    for r in raw:
        case = r.get("case")
        if case not in ("decode", "prefill") or "error" in r:
            continue
        impl = str(r.get("impl", default))
        if "naive" in impl:
            continue
        backend, variant = _impl_name(impl, default)
        shape: str = r.get("shape") or f"{r.get('batch')}x{r.get('ctx', r.get('len'))}"
        value = r.get("kv_GBps", r.get("gbps")) if case == "decode" else r.get(
            "TFLOPs", r.get("tflops"))
        if value is None:
            continue
        rows.append({"backend": backend, "variant": variant, "case": case, "shape": shape,
                     "value": float(value), "ms": r.get("ms"), "source": source})
        sdpa = r.get("sdpa_TFLOPs", r.get("sdpa_tflops"))
        if case == "prefill" and sdpa is not None:
            rows.append({"backend": _SDPA, "variant": None, "case": case, "shape": shape,
                         "value": float(sdpa), "ms": r.get("sdpa_ms"), "source": source})
    return _dedupe(rows)


def _dedupe(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (backend, case, shape): the ``auto`` variant, else the first plain row,
    else the fastest variant."""
    best: dict[tuple[str, str, str], dict[str, Any]] = {}
    for r in rows:
        key = (r["backend"], r["case"], r["shape"])
        old = best.get(key)
        rank = (r["variant"] == "auto", r["variant"] is None)
        if old is None:
            best[key] = r
            continue
        old_rank = (old["variant"] == "auto", old["variant"] is None)
        if rank > old_rank or (rank == old_rank and rank == (False, False)
                               and r["value"] > old["value"]):
            best[key] = r
    return list(best.values())


def heads_label(heads: HeadShape) -> str:
    """``"32 q / 8 KV heads, head 128"``: the heads of a report, for captions."""
    return f"{heads.num_heads} q / {heads.num_kv_heads} KV heads, head {heads.head_size}"


def report_heads(data: dict[str, Any]) -> str:
    """`heads_label` of a kernel report's ``config`` (the default heads when it has none)."""
    cfg = data.get("config")
    if isinstance(cfg, dict) and all(
            isinstance(cfg.get(k), int) for k in ("num_heads", "num_kv_heads", "head_size")):
        return heads_label(HeadShape(cfg["num_heads"], cfg["num_kv_heads"], cfg["head_size"]))
    return heads_label(DEFAULT_HEADS)


def measure_live(*, small: bool, names: Sequence[str],
                 heads: HeadShape = DEFAULT_HEADS) -> tuple[list[dict[str, Any]], Any]:
    """Rows measured now with `pagedcore.bench.kernels` (``bench_uniform``) at `heads`."""
    import torch

    from pagedcore.bench import kernels

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)
        if not small:
            raise click.UsageError("no CUDA device: pass --small for the CPU shapes, or plot "
                                   "committed GPU reports with --from-json")
    torch.manual_seed(0)
    chosen, skipped = kernels._pick_backends(tuple(names), device, heads=heads)
    for s in skipped:
        click.echo(f"skipped {s}", err=True)
    shapes = kernels.QUICK if small else kernels.FULL
    copy_gbps = kernels.copy_bandwidth_gbps(device, quick=small)
    raw: list[dict[str, Any]] = []
    for case in ("decode", "prefill"):
        for batch, length in shapes[case]:
            raw += kernels.bench_uniform(case, batch, length, chosen, device, copy_gbps,
                                         heads=heads)
    return normalize_report({"results": raw}, source="live"), device


def _plot(report: dict[str, Any], path: str) -> None:
    from pagedcore.bench.report import save_figure, subplots

    rows = report["rows"]
    # One colour per backend across both panels (the SDPA baseline grey).
    everyone = sorted({r["backend"] for r in rows if r["backend"] != _SDPA})
    colour = {name: f"C{i % 10}" for i, name in enumerate(everyone)} | {_SDPA: "0.6"}
    fig, axes = subplots(2, width=6.0, height=4.4)
    for ax, case, unit in ((axes[0], "decode", "KV read GB/s"),
                           (axes[1], "prefill", "TFLOP/s")):
        sel = [r for r in rows if r["case"] == case]
        shapes = list(dict.fromkeys(r["shape"] for r in sel))
        names = sorted({r["backend"] for r in sel}, key=lambda n: (n == _SDPA, n))
        width = 0.8 / max(1, len(names))
        for i, name in enumerate(names):
            vals = {r["shape"]: r["value"] for r in sel if r["backend"] == name}
            xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(shapes))]
            ax.bar(xs, [vals.get(s, 0.0) for s in shapes], width, label=name,
                   color=colour[name])
        if case == "decode" and report.get("copy_bandwidth_GBps"):
            ax.axhline(report["copy_bandwidth_GBps"], color="tab:red", ls="--", lw=0.8,
                       label="device copy bandwidth")
        ceiling = report.get("copy_bandwidth_GBps") if case == "decode" else None
        top = max([r["value"] for r in sel] + [ceiling or 0.0])
        ax.set_ylim(0, 1.35 * top if top > 0 else 1.0)  # room for the legend
        ax.set_xticks(range(len(shapes)), shapes)
        ax.set_xlabel("batch x context" if case == "decode" else "batch x prompt (causal)")
        ax.set_ylabel(unit)
        ax.set_title(f"{case}: {unit}")
        ax.legend(fontsize=7, loc="upper left", ncol=2)
    save_figure(fig, path, caption=f"{report['device']} · {report['heads']}, block 16 · "
                f"sources: {', '.join(report['sources'])}")


@click.command()
@click.option("--small", is_flag=True, help="Quick shapes (live measurement also on CPU).")
@click.option("--backend", "names", multiple=True, type=BACKEND,
              help="Backend to time (live; default: all).")
@click.option("--from-json", "sources", multiple=True,
              type=click.Path(exists=True, dir_okay=False),
              help="Plot committed kernel reports instead of measuring (repeatable).")
@click.option("--json", "json_path", default=None, type=OutputPath(),
              help="Write the figures to this JSON file.")
@click.option("--plot", "plot_path", default=None, type=OutputPath(),
              help="Write the plot to this image file (png, svg, ...).")
@head_options
def backends(small: bool, names: tuple[str, ...], sources: tuple[str, ...],
             json_path: str | None, plot_path: str | None, heads_text: str | None,
             head_size: int | None) -> None:
    """Every backend's decode GB/s and prefill TFLOP/s on the same shapes, one plot."""
    import json

    from rich.console import Console
    from rich.table import Table

    from pagedcore.bench.report import environment, write_json

    if sources and (heads_text is not None or head_size is not None):
        raise click.UsageError("--heads / --head-size set the heads of a live run; the "
                               "reports given with --from-json carry their own")
    heads = parse_heads(heads_text, head_size)
    report: dict[str, Any]
    if sources:
        rows: list[dict[str, Any]] = []
        devices, copies, labels = set(), [], []
        for path in sources:
            with open(path) as fh:
                data = json.load(fh)
            rows += normalize_report(data, source=os.path.basename(path))
            labels.append(report_heads(data))
            devices.add(str(data.get("device", "?")).split(",")[0])
            cb = data.get("copy_bandwidth_GBps", data.get("copy", {}).get("copy_gbps"))
            if isinstance(cb, dict):
                cb = max(cb.values())
            if isinstance(cb, (int, float)):
                copies.append(float(cb))
        report = {"device": " / ".join(sorted(devices)), "sources": [os.path.basename(p)
                                                                   for p in sources],
                  "copy_bandwidth_GBps": max(copies) if copies else None,
                  "environment": environment(_cpu()), "rows": _dedupe(rows),
                  "heads": " + ".join(dict.fromkeys(labels))}
    else:
        with progress_bar("bench backends (live)", None):
            live, device = measure_live(small=small, names=names, heads=heads)
        env = environment(device)
        report = {"device": env["device"], "sources": ["live"], "copy_bandwidth_GBps": None,
                  "environment": env, "rows": live, "heads": heads_label(heads)}
    report["experiment"] = "backends: decode bandwidth and prefill TFLOP/s"
    table = Table(title=f"backends on {report['device']}")
    for col in ("case", "shape", "backend", "variant", "value", "source"):
        table.add_column(col)
    for r in sorted(report["rows"], key=lambda r: (r["case"], r["shape"], r["backend"])):
        unit = "GB/s" if r["case"] == "decode" else "TFLOP/s"
        table.add_row(r["case"], r["shape"], r["backend"], r["variant"] or "",
                      f"{r['value']:.3g} {unit}", r["source"])
    Console(width=140).print(table)
    if json_path:
        write_json(json_path, report)
        click.echo(f"wrote {json_path}")
    if plot_path:
        _plot(report, plot_path)
        click.echo(f"wrote {plot_path}")


def _cpu() -> Any:
    import torch

    return torch.device("cpu")
