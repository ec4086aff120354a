"""fp8 / bf16 decode speed-up of cuda_paged, grouped kernel vs keys-as-rows (3-stage ring),
from the session-25 H100 round (`r3_ring3/bench_decode_*.json`): writes fp8_decode.png.

    python docs/benchmarks/h100_s25/plot_fp8.py
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

HERE = Path(__file__).resolve().parent
SHAPES = ["64x4096", "8x32768", "256x1024"]


def _ms(path: Path) -> dict[str, float]:
    rows = json.loads(path.read_text())["results"]
    return {r["shape"]: r["ms"] for r in rows if r.get("impl") == "cuda_paged"}


def main() -> None:
    raw = HERE / "r3_ring3"
    series = {}
    for kernel, label in (("rows", "grouped kernel (heads as M rows)"),
                          ("ring3", "keys as M rows, 3-stage ring (default)")):
        bf16, fp8 = _ms(raw / f"bench_decode_{kernel}_auto.json"), _ms(
            raw / f"bench_decode_{kernel}_fp8.json")
        series[label] = [bf16[s] / fp8[s] for s in SHAPES]
    x = np.arange(len(SHAPES))
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for i, (label, vals) in enumerate(series.items()):
        bars = ax.bar(x + (i - 0.5) * 0.38, vals, 0.38, label=label)
        ax.bar_label(bars, fmt="%.2fx", fontsize=8)
    ax.axhline(1.8, color="k", lw=0.8, ls="--", label="issue 24 target (1.8x)")
    ax.set_xticks(x, SHAPES)
    ax.set_xlabel("batch x context (32 / 8 heads, d128, block 16)")
    ax.set_ylabel("fp8 (e4m3) speed-up over bf16")
    ax.set_ylim(1.0, 2.15)
    ax.set_title("cuda_paged decode, H100, pagedcore bench kernels (541f765)")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(HERE / "fp8_decode.png", dpi=120)


if __name__ == "__main__":
    main()
