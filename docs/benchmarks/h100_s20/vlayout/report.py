"""Report of one `gpu_job.sh` run: the fp8 V layouts against bf16, as a table and a plot.

    python docs/benchmarks/h100_s20/vlayout/report.py docs/benchmarks/h100_s20/vlayout

(The transposed layout was removed after this measurement; the job and this report ran
at 83e6a68.)

Reads ``kernels_{auto,fp8,fp8_token}.json`` (`pagedcore bench kernels --case decode`, the
CUDA-graph rows of the triton backend), ``kernels_fp8_prefill{,_token}.json`` (the prefill
case) and ``sweep_round5.jsonl`` (fp8_decode_sweep.py round5: the layouts and tile variants,
each checked against a float32 reference before it was timed); writes ``report.md`` and
``fp8_vlayout.png`` into RESULT_DIR.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

DECODE = {"bf16": "kernels_auto.json", "fp8 token-major V": "kernels_fp8_token.json",
          "fp8 V transposed": "kernels_fp8.json"}
PREFILL = {"fp8 token-major V": "kernels_fp8_prefill_token.json",
           "fp8 V transposed": "kernels_fp8_prefill.json"}


def bench_rows(path: Path, impl: str) -> dict[str, dict[str, Any]]:
    """``shape -> row`` of one implementation in a `pagedcore bench kernels` JSON."""
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return {r["shape"]: r for r in data["results"] if r["impl"] == impl}


def sweep_table(path: Path) -> list[str]:
    """Markdown rows: every correct sweep variant per shape, fastest first, with its ratio to
    the bf16 default of the same run."""
    if not path.exists():
        return ["(no sweep file)"]
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    head, rows = lines[0], lines[1:]
    out = [f"Sweep (`fp8_decode_sweep.py round5`, {head.get('device')}, copy "
           f"{head.get('copy_bandwidth_GBps', 0):.0f} GB/s): us per launch, % of copy on the "
           "bytes the cache holds, ratio to the bf16 default; `v` = V transposed, `s` = "
           "unmasked interior tiles, `o` = int32 offsets.", "",
           "| shape | kv | variant (cvt, tile, warps, stages, segments, flags) | us | % copy | "
           "vs bf16 | rel. err |", "|---|---|---|---:|---:|---:|---:|"]
    bad = [r for r in rows if "error" in r or r.get("nan") or r.get("rel_err", 1) >= 0.05]
    ok = [r for r in rows if r not in bad and "ms" in r]
    for shape in dict.fromkeys(f"{r['B']}x{r['L']}" for r in rows):
        mine = [r for r in ok if f"{r['B']}x{r['L']}" == shape]
        bf16 = next((r["ms"] for r in mine if r["kv"] == "bf16"), None)
        for r in sorted(mine, key=lambda r: r["ms"]):
            ratio = f"{bf16 / r['ms']:.2f}x" if bf16 else "-"
            out.append(f"| {shape} | {r['kv']} | cvt{r['cvt']} {r['tile']} {r['warps']} "
                       f"{r['stages']} s{r['segs']} {r['flags'] or '-'} | {r['ms'] * 1e3:.1f} | "
                       f"{r['pct_copy']:.0f} | {ratio} | {r['rel_err']:.1e} |")
    for r in bad:
        out.append(f"| FAILED | {json.dumps(r)[:300]} |")
    return out


def main() -> None:
    root = Path(sys.argv[1])
    decode = {name: bench_rows(root / f, "triton+cudagraph") for name, f in DECODE.items()}
    prefill = {name: bench_rows(root / f, "triton") for name, f in PREFILL.items()}
    shapes = list(dict.fromkeys(s for rows in decode.values() for s in rows))
    lines = ["# fp8 KV cache with V transposed within each block (triton backend)", "",
             "Decode, CUDA graphs (`pagedcore bench kernels --backend triton --case decode`, "
             "ms; fp8 rows: ratio to bf16, % of copy bandwidth on the fp8 bytes):", "",
             "| shape | " + " | ".join(DECODE) + " |", "|---" * (len(DECODE) + 1) + "|"]
    for shape in shapes:
        bf16 = decode["bf16"].get(shape, {}).get("ms")
        cells = []
        for name in DECODE:
            row = decode[name].get(shape)
            if row is None:
                cells.append("-")
            elif name == "bf16":
                cells.append(f"{row['ms']:.4f} ({row['pct_copy']:.0f} %)")
            else:
                ratio = f"{bf16 / row['ms']:.2f}x, " if bf16 else ""
                cells.append(f"{row['ms']:.4f} ({ratio}{row['pct_copy']:.0f} %)")
        lines.append(f"| {shape} | " + " | ".join(cells) + " |")
    lines += ["", "Prefill with an fp8 cache (eager, TFLOP/s):", "",
              "| shape | " + " | ".join(PREFILL) + " |", "|---" * (len(PREFILL) + 1) + "|"]
    for shape in dict.fromkeys(s for rows in prefill.values() for s in rows):
        cells = [f"{prefill[n][shape]['TFLOPs']:.0f}" if shape in prefill[n] else "-"
                 for n in PREFILL]
        lines.append(f"| {shape} | " + " | ".join(cells) + " |")
    lines += ["", *sweep_table(root / "sweep_round5.jsonl"), ""]
    (root / "report.md").write_text("\n".join(lines))
    print("\n".join(lines[:12 + len(shapes)]))
    plot(root, decode, shapes)


def plot(root: Path, decode: dict[str, dict[str, dict[str, Any]]], shapes: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.26
    colors = {"bf16": "#9e9e9e", "fp8 token-major V": "#9ecae1", "fp8 V transposed": "#1f77b4"}
    for i, shape in enumerate(shapes):
        bf16 = decode["bf16"].get(shape, {}).get("ms")
        for j, name in enumerate(DECODE):
            row = decode[name].get(shape)
            if row is None:
                continue
            x = i + (j - 1) * width
            ax.bar(x, row["ms"] * 1e3, width, color=colors[name], label=name if i == 0 else None)
            if name != "bf16" and bf16:
                ax.text(x, row["ms"] * 1e3, f"{bf16 / row['ms']:.2f}x", ha="center",
                        va="bottom", fontsize=8)
    ax.set_xticks(range(len(shapes)), shapes)
    ax.set_xlabel("decode batch x context (32 query / 8 KV heads, head size 128)")
    ax.set_ylabel("us per layer (CUDA graph)")
    ax.set_title("triton decode: bf16 vs fp8 cache, V token-major vs transposed")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(root / "fp8_vlayout.png", dpi=120)


if __name__ == "__main__":
    main()
