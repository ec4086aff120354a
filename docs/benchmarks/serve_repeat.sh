#!/usr/bin/env bash
# Issue 23's ratio with repeats, in one device call: `LLM.generate` on the issue's workload
# (1,000 requests, input 128-2,048, output 128-512, greedy, ignore_eos) once per seed in one
# process, then `pagedcore serve` (default --stream-interval 1) with `pagedcore bench serve`
# at rate inf once per seed (each seed its own prompts: neither side reuses a cached prefix of
# an earlier repeat), then one rate below saturation with fresh prompts. summary.json has the
# ratio per seed, their mean and spread, and the engine loop's phases per served run.
#
#   OUT=/tmp/r MODEL=qwen2-0.5b SEEDS="0 1000 2000" bash docs/benchmarks/serve_repeat.sh
#
# Environment: OUT (results), MODEL (random:<MODEL>; qwen2-0.5b), SEEDS, NUM_REQUESTS (1000),
# LOW_RATE / LOW_N (16 req/s, 160 requests; LOW_RATE= skips it), BENCH_WORKERS (4), PORT.
# CPU smoke test: SMOKE=1 OUT=/tmp/r bash docs/benchmarks/serve_repeat.sh
set -u
cd "$(dirname "$0")/../.."
D="${OUT:-/tmp/serve_repeat}"; mkdir -p "$D"
M="${MODEL:-qwen2-0.5b}"; SEEDS="${SEEDS:-0 1000 2000}"; N="${NUM_REQUESTS:-1000}"
PORT="${PORT:-8011}"; IN=128:2048; OUTLEN=128:512; MML=4096; DEV=""
LOW_RATE="${LOW_RATE-16}"; LOW_N="${LOW_N:-160}"
if [ -n "${SMOKE:-}" ]; then
  M=llama; SEEDS="0 1"; N=6; IN=8:16; OUTLEN=3:5; MML=256; DEV="--device cpu"; LOW_RATE=50; LOW_N=4
fi
ENGINE_ARGS="--max-model-len $MML --max-num-seqs 256 --max-num-batched-tokens 8192"
echo "serve_repeat.sh: $M, seeds $SEEDS, at ${PAGEDCORE_GIT_COMMIT:-$(git rev-parse --short HEAD)}"
rc=0
python - "$M" "$N" "$D" "$IN" "$OUTLEN" "$MML" "$DEV" $SEEDS <<'PY' || { echo "FAILED: generate"; exit 1; }
import json, os, sys, time
from pagedcore import LLM, SamplingParams
from pagedcore.bench.serve import make_workload
model, n, out, i_len, o_len, mml, dev, *seeds = sys.argv[1:]
rng = lambda t: tuple(int(x) for x in (t.split(":") * 2)[:2])
llm = LLM(f"random:{model}", max_model_len=int(mml), max_num_seqs=256,
          max_num_batched_tokens=8192, device="cpu" if dev else None)
llm.generate([[5] * 64] * 8, SamplingParams(max_tokens=16, ignore_eos=True))  # compile, warm
for seed in map(int, seeds):
    work = make_workload(int(n), input_len=rng(i_len), output_len=rng(o_len), seed=seed,
                         token_range=(3, 120))
    params = [SamplingParams(max_tokens=w.output_len, temperature=0, ignore_eos=True)
              for w in work]
    s0, h0 = llm.num_steps, llm.step_time
    t0 = time.perf_counter()
    outs = llm.generate([w.prompt for w in work], params)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    rep = {"model": model, "seed": seed, "commit": os.environ.get("PAGEDCORE_GIT_COMMIT"),
           "requests": len(work), "elapsed_s": elapsed, "output_tokens": tokens,
           "output_throughput": tokens / elapsed, "steps": llm.num_steps - s0,
           "step_time_s": llm.step_time - h0}
    json.dump(rep, open(f"{out}/generate_{seed}.json", "w"), indent=1)
    print(f"generate seed {seed}: {tokens / elapsed:,.0f} tok/s in {elapsed:.2f} s")
PY
TRACE="$D/step_trace.jsonl"; rm -f "$TRACE"
# shellcheck disable=SC2086
PAGEDCORE_STEP_TRACE="$TRACE" pagedcore serve "random:$M" --port "$PORT" $ENGINE_ARGS $DEV \
  --max-waiting 4096 --log-level warning > "$D/serve.log" 2>&1 &
pid=$!
up=0
for _ in $(seq 600); do
  kill -0 "$pid" 2>/dev/null || break
  curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && { up=1; break; }
  sleep 0.5
done
if [ "$up" != 1 ]; then echo "FAILED: the server did not come up"; tail -20 "$D/serve.log"; kill "$pid"; exit 1; fi
for seed in $SEEDS; do
  pagedcore bench serve --base-url "http://127.0.0.1:$PORT" --num-requests "$N" --input-len "$IN" \
    --output-len "$OUTLEN" --token-id-range 3:120 --request-rate inf --seed "$seed" \
    --slo-ttft-ms 1000 --json "$D/bench_serve_$seed.json" --num-workers "${BENCH_WORKERS:-4}" \
    --no-progress > "$D/bench_serve_$seed.txt" 2>&1 || { echo "FAILED: bench seed $seed"; rc=1; }
  tail -4 "$D/bench_serve_$seed.txt"
  sleep 0.5  # the engine loop flushes its trace once idle
done
if [ -n "$LOW_RATE" ]; then
  pagedcore bench serve --base-url "http://127.0.0.1:$PORT" --num-requests "$LOW_N" --input-len "$IN" \
    --output-len "$OUTLEN" --token-id-range 3:120 --request-rate "$LOW_RATE" --seed 77 \
    --slo-ttft-ms 1000 --json "$D/bench_serve_low.json" --num-workers "${BENCH_WORKERS:-4}" \
    --no-progress > "$D/bench_serve_low.txt" 2>&1 || { echo "FAILED: low rate"; rc=1; }
  tail -4 "$D/bench_serve_low.txt"
fi
curl -s "http://127.0.0.1:$PORT/metrics" > "$D/metrics.txt"
kill -TERM "$pid"
for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
kill -KILL "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
python - "$D" $SEEDS <<'PY' || rc=1
import json, os, sys
import numpy as np
from pagedcore.serve.step_trace import read, summarize
d, *seeds = sys.argv[1:]
rows = read(f"{d}/step_trace.jsonl") if os.path.exists(f"{d}/step_trace.jsonl") else []
per = []
for seed in seeds:
    gen = json.load(open(f"{d}/generate_{seed}.json"))
    run = json.load(open(f"{d}/bench_serve_{seed}.json"))["runs"][0]["summary"]
    clock = run["clock"]
    per.append({"seed": int(seed), "generate_tok_s": gen["output_throughput"],
                "serve_tok_s": run["output_throughput"],
                "ratio": run["output_throughput"] / gen["output_throughput"],
                "errors": run["errors"], "completed": run["completed"],
                "ttft_p99_ms": run["ttft_ms"]["p99"], "clock": clock,
                "engine_trace": summarize(rows, clock["first_send"], clock["last_token"])
                if rows else None})
ratios = np.array([p["ratio"] for p in per])
summary = {"commit": os.environ.get("PAGEDCORE_GIT_COMMIT"), "runs": per,
           "ratio_mean": float(ratios.mean()), "ratio_min": float(ratios.min()),
           "ratio_max": float(ratios.max()),
           "ratio_of_means": float(np.mean([p["serve_tok_s"] for p in per])
                                   / np.mean([p["generate_tok_s"] for p in per]))}
if os.path.exists(f"{d}/bench_serve_low.json"):
    low = json.load(open(f"{d}/bench_serve_low.json"))["runs"][0]
    summary["low_rate"] = {"rate": low["request_rate"], "completed": low["summary"]["completed"],
                           "errors": low["summary"]["errors"],
                           "ttft_p99_ms": low["summary"]["ttft_ms"]["p99"]}
json.dump(summary, open(f"{d}/summary.json", "w"), indent=1)
for p in per:
    trace = p["engine_trace"] or {}
    print(f"seed {p['seed']}: serve {p['serve_tok_s']:,.0f} / generate {p['generate_tok_s']:,.0f}"
          f" = {p['ratio']:.3f}x, errors {p['errors']}; emit {trace.get('emit_s', 0):.2f} s,"
          f" gc {json.dumps(trace.get('gc'))}")
print(f"mean {summary['ratio_mean']:.3f}x (min {summary['ratio_min']:.3f}, max "
      f"{summary['ratio_max']:.3f}); low rate: {summary.get('low_rate')}")
PY
exit $rc
