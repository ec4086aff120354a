"""When the 1,000 requests of the rate-inf run reached the engine, before and after the eager
submission (serve_b at 969b38d, serve_c at 5a5c872), from the engine's step trace on the
client's clock: requests added (left axis) and tokens the engine scheduled (right axis).

    python docs/benchmarks/h200_s15/plot_arrivals.py   # writes arrivals.png here
"""
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = os.path.dirname(os.path.abspath(__file__))
fig, ax = plt.subplots(figsize=(8, 4.5))
tok_ax = ax.twinx()
for run, label, color in (("serve_b", "969b38d: add on first iteration", "tab:red"),
                          ("serve_c", "5a5c872: add in the handler", "tab:blue")):
    clock = json.load(open(os.path.join(HERE, run, "cpu_qwen2-0.5b.json")))["client_clock"]
    t0 = clock["first_send"]
    rows = [json.loads(line) for line in open(os.path.join(HERE, run, "step_trace_rate_inf.jsonl"))]
    ts, adds, n = [], [], 0
    tt, toks, m = [], [], 0
    for r in rows:
        if r["ev"] == "cmd":
            n += r["add"]
            ts.append(r["t"] - t0)
            adds.append(n)
        elif r["ev"] == "step":
            m += r["tokens"]
            tt.append(r["t"] + r["step_s"] - t0)
            toks.append(m / 1e6)
    ax.step(ts, adds, where="post", color=color, label=f"requests added, {label}")
    tok_ax.plot(tt, toks, color=color, ls=":", label=f"tokens scheduled, {label}")
    ax.axvline(clock["last_token"] - t0, color=color, lw=0.8, ls="--")
ax.set_xlabel("seconds since the client's first request (dashed: its last token)")
ax.set_ylabel("requests added to the engine")
tok_ax.set_ylabel("tokens scheduled (millions)")
ax.set_title("Qwen2-0.5B server, 1,000 requests at rate inf (H200)")
lines = ax.get_legend_handles_labels()
more = tok_ax.get_legend_handles_labels()
ax.legend(lines[0] + more[0], lines[1] + more[1], loc="center right", fontsize=8)
fig.tight_layout()
fig.savefig(os.path.join(HERE, "arrivals.png"), dpi=110)
