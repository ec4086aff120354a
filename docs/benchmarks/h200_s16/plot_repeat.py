"""Issue 23's ratio over repeats (Qwen2-0.5B, 1,000 requests at rate inf, H200): left, server /
`LLM.generate` per seed at 7e3c38e (aiohttp client) and 8b4497b (+ frozen startup heap,
uvloop + httptools); right, when the requests reached the engine (its step trace on the
client's clock) for the first seed of each, beside session 15's httpx client (5a5c872).

    python docs/benchmarks/h200_s16/plot_repeat.py   # writes repeat.png here
"""
import gzip
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = os.path.dirname(os.path.abspath(__file__))
S15 = os.path.join(HERE, "..", "h200_s15", "serve_c")
RUNS = (("serve_repeat_first", "7e3c38e: aiohttp client", "tab:orange"),
        ("serve_repeat", "8b4497b: + gc.freeze, uvloop + httptools", "tab:blue"))


def adds_over_time(rows, t0, t1):
    ts, adds, n = [], [], 0
    for r in rows:
        if r["ev"] == "cmd" and t0 <= r["t"] <= t1:
            n += r["add"]
            ts.append(r["t"] - t0)
            adds.append(n)
    return ts, adds


fig, (bars, arr) = plt.subplots(1, 2, figsize=(12, 4.5))
width = 0.38
for k, (run, label, color) in enumerate(RUNS):
    summary = json.load(open(os.path.join(HERE, run, "summary.json")))
    xs = [i + (k - 0.5) * width for i in range(len(summary["runs"]))]
    ratios = [r["ratio"] for r in summary["runs"]]
    bars.bar(xs, ratios, width, color=color,
             label=f"{label} (mean {summary['ratio_mean']:.3f}x)")
    for x, r in zip(xs, ratios, strict=True):
        bars.text(x, r + 0.005, f"{r:.3f}", ha="center", fontsize=8)
    with gzip.open(os.path.join(HERE, run, "step_trace.jsonl.gz"), "rt") as f:
        rows = [json.loads(line) for line in f]
    clock = summary["runs"][0]["clock"]
    ts, adds = adds_over_time(rows, clock["first_send"], clock["last_token"])
    arr.step(ts, adds, where="post", color=color, label=f"{label}, seed 0")
bars.axhline(0.9, color="k", lw=0.8, ls="--", label="target 0.9x")
bars.set_xticks(range(4), ["seed 0", "seed 1000", "seed 2000", "seed 3000"])
bars.set_ylim(0.8, 1.14)
bars.set_ylabel("server tok/s / LLM.generate tok/s")
bars.set_title("server at saturation over generate, per seed")
bars.legend(fontsize=8, loc="upper left")
clock = json.load(open(os.path.join(S15, "cpu_qwen2-0.5b.json")))["client_clock"]
rows = [json.loads(line) for line in open(os.path.join(S15, "step_trace_rate_inf.jsonl"))]
ts, adds = adds_over_time(rows, clock["first_send"], clock["last_token"])
arr.step(ts, adds, where="post", color="tab:red", label="5a5c872: httpx client (session 15)")
arr.set_xlim(0, 6)
arr.set_xlabel("seconds since the client's first request")
arr.set_ylabel("requests added to the engine")
arr.set_title("when the 1,000 requests reached the engine")
arr.legend(fontsize=8, loc="lower right")
fig.tight_layout()
fig.savefig(os.path.join(HERE, "repeat.png"), dpi=110)
