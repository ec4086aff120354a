"""Figure of a `pagedcore bench mla` report (issue 8): cache bytes and concurrency, decode
bandwidth against the copy, and where the time of each shape goes.

    python -m pagedcore.bench.mla_plot docs/benchmarks/mla_h200.json docs/benchmarks/mla_h200.png

Panels: KV bytes per token and the most requests a KV budget holds (MLA latent against the
decompressed per-head K/V); each timed variant's bandwidth as % of the measured copy per
shape with the 80 % target; the breakdown variant's ``forward`` per shape split into the
decode kernel and the rest (merge and the gap between them), against the time 80 % of copy
would allow.
"""

from __future__ import annotations

import json
import sys
from typing import Any

__all__ = ["plot_mla"]


def _shape(row: dict[str, Any]) -> str:
    return f"{row['batch']}x{row['context']}"


def _capacity(ax: Any, capacity: list[dict[str, Any]]) -> None:
    names = [c["model"] for c in capacity]
    xs = range(len(names))
    mla = [c["mla_max_requests"] for c in capacity]
    full = [c["decompressed_max_requests"] for c in capacity]
    ax.bar([x - 0.2 for x in xs], mla, 0.4, label="MLA latent cache", color="tab:blue")
    ax.bar([x + 0.2 for x in xs], full, 0.4, label="decompressed K/V", color="tab:gray")
    for x, c in zip(xs, capacity, strict=True):
        ax.annotate(f"{c['mla_max_requests']}\n{c['mla_bytes_per_token'] / 1024:.0f} KiB/token",
                    (x - 0.2, c["mla_max_requests"]), ha="center", va="bottom", fontsize=7)
        ax.annotate(f"{c['decompressed_max_requests']}\n"
                    f"{c['decompressed_bytes_per_token'] / 1024:.0f} KiB/token",
                    (x + 0.2, max(1, c["decompressed_max_requests"])), ha="center",
                    va="bottom", fontsize=7)
    ax.set_xticks(list(xs), names)
    ax.set_yscale("log")
    ax.set_ylim(1, 10 * max(mla))
    budget = capacity[0]
    ax.set_ylabel(f"requests of {budget['context']} tokens in {budget['kv_budget_GiB']:.0f} GiB")
    ax.set_title("KV cache: bytes per token, concurrency")
    ax.legend(fontsize=7)


def _bandwidth(ax: Any, summary: dict[str, Any]) -> None:
    per_variant = summary["variant_pct_of_copy_per_shape"]
    variants = list(per_variant)
    shapes = list(next(iter(per_variant.values())))
    width = 0.8 / max(1, len(variants))
    for i, name in enumerate(variants):
        xs = [s + (i - (len(variants) - 1) / 2) * width for s in range(len(shapes))]
        vals = [per_variant[name].get(shape, 0.0) for shape in shapes]
        label = name + (" (default)" if i == 0 else "")
        ax.bar(xs, vals, width, label=label)
        if i == 0:
            for x, v in zip(xs, vals, strict=True):
                ax.annotate(f"{v:.1f}", (x, v), ha="center", va="bottom", fontsize=7)
    ax.axhline(summary.get("target_pct", 80.0), color="tab:red", ls="--", lw=1,
               label="target")
    ax.set_xticks(range(len(shapes)), shapes, fontsize=8)
    ax.set_ylim(0, 100)
    ax.set_ylabel("latent-cache bytes / forward time, % of copy")
    ax.set_title("Triton MLA decode (16 heads, 512 + 64)")
    ax.legend(fontsize=6, loc="lower right")


def _breakdown(ax: Any, rows: list[dict[str, Any]], copy_gbps: float, target: float) -> None:
    if not rows:
        ax.set_axis_off()
        return
    name = rows[0]["variant"]
    rows = [r for r in rows if r["variant"] == name]
    shapes = [_shape(r) for r in rows]
    decode = [1e3 * r["decode_ms"] for r in rows]
    rest = [max(0.0, 1e3 * (r["forward_ms"] - r["decode_ms"])) for r in rows]
    allowed = [r["kv_bytes"] / (copy_gbps * 1e3 * target / 100) for r in rows]
    xs = range(len(shapes))
    ax.bar(xs, decode, 0.6, label="decode kernel alone", color="tab:blue")
    ax.bar(xs, rest, 0.6, bottom=decode, label="rest of forward (merge, gaps)",
           color="tab:orange")
    ax.scatter(xs, allowed, marker="_", s=600, color="tab:red", zorder=3,
               label=f"time at {target:.0f} % of copy")
    ax.set_xticks(list(xs), shapes, fontsize=8)
    ax.set_ylim(0, 1.45 * max(max(allowed), *(d + r for d, r in zip(decode, rest, strict=True))))
    ax.set_ylabel("µs per forward")
    ax.set_title(f"where the time goes ({name})", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", ncol=2)


def plot_mla(report: dict[str, Any], path: str) -> None:
    """Draw `report` (a `pagedcore bench mla --json` file's content) as a PNG at `path`."""
    from pagedcore.bench.report import save_figure, subplots

    fig, (a1, a2, a3) = subplots(3, width=5.2)
    _capacity(a1, report["capacity"])
    summary = report.get("summary") or {}
    if summary.get("variant_pct_of_copy_per_shape"):
        _bandwidth(a2, summary)
    else:
        a2.set_axis_off()
    copy = report.get("copy_bandwidth_GBps") or 0.0
    if copy:
        _breakdown(a3, report.get("breakdown") or [], copy, summary.get("target_pct", 80.0))
    else:
        a3.set_axis_off()
    save_figure(fig, path, caption=f"{report.get('device', '?')} · torch {report.get('torch')}"
                f" · copy {copy:.0f} GB/s · commit {report.get('git_commit')}")


def main(argv: list[str] | None = None) -> None:
    """``python -m pagedcore.bench.mla_plot REPORT.json OUT.png``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        raise SystemExit("usage: python -m pagedcore.bench.mla_plot REPORT.json OUT.png")
    with open(args[0]) as fh:
        plot_mla(json.load(fh), args[1])
    print(f"wrote {args[1]}")


if __name__ == "__main__":
    main()
