"""fp8 against bf16 KV-cache decode, triton and FlashInfer side by side (one GPU run).

    python docs/benchmarks/h100_s19/plot_fp8.py    # writes fp8_decode.png beside this file

Reads the `pagedcore bench kernels --case decode` JSON of the run (``--kv-cache-dtype`` auto,
fp8_e4m3, fp8_e5m2) and plots each backend's CUDA-graph time per shape, with fp8 / bf16 above
the fp8 bars.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = Path(__file__).parent
BACKENDS = ("triton", "flashinfer")
KVS = ("auto", "fp8_e4m3", "fp8_e5m2")


def load() -> dict[tuple[str, str, str], float]:
    """``(backend, kv, shape) -> ms`` of the CUDA-graph rows."""
    out = {}
    for kv in KVS:
        data = json.loads((HERE / f"kernels_decode_{kv}_h100.json").read_text())
        for row in data["results"]:
            name = row["impl"].removesuffix("+cudagraph")
            if row["impl"].endswith("+cudagraph") and name in BACKENDS:
                out[(name, kv, row["shape"])] = row["ms"]
    return out


def main() -> None:
    ms = load()
    shapes = list(dict.fromkeys(s for _, _, s in ms))  # the bench's order
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.13
    colors = {"auto": "#9e9e9e", "fp8_e4m3": "#1f77b4", "fp8_e5m2": "#6baed6"}
    for i, shape in enumerate(shapes):
        for j, backend in enumerate(BACKENDS):
            for k, kv in enumerate(KVS):
                x = i + (j * len(KVS) + k - 2.5) * width + (0.06 if j else -0.06)
                value = ms[(backend, kv, shape)]
                ax.bar(x, value, width, color=colors[kv], edgecolor="black" if j else "none",
                       hatch="//" if j else None,
                       label=f"{backend} {'bf16' if kv == 'auto' else kv}" if i == 0 else None)
                if kv != "auto":
                    ratio = ms[(backend, "auto", shape)] / value
                    ax.text(x, value + 0.004, f"{ratio:.2f}x", ha="center", fontsize=7)
    ax.set_xticks(range(len(shapes)), [f"{s} (requests x tokens)" for s in shapes])
    ax.set_ylabel("decode attention, ms (CUDA graph, L2 flushed)")
    ax.set_title("fp8 vs bf16 KV cache, 32 q / 8 KV heads, d128 (H100, one run; fp8 / bf16 above)")
    ax.set_ylim(0, 0.46)
    ax.legend(fontsize=8, ncol=3, loc="upper center")
    fig.tight_layout()
    fig.savefig(HERE / "fp8_decode.png", dpi=120)


if __name__ == "__main__":
    main()
