#!/usr/bin/env bash
# `pagedcore bench serve` against `pagedcore serve` on full-size model shapes with random
# weights (issue 23's H200 part), plus the same workload through `LLM.generate` for the
# throughput ratio.
#
#   pip install -e ".[serve]" -e backends/triton ...   # the web stack must be installed:
#     on a machine without network, `pip download -d wheels fastapi uvicorn prometheus-client
#     httpx` elsewhere and `pip install --no-index -f wheels fastapi uvicorn prometheus-client
#     httpx` here
#   OUT=/some/dir bash docs/benchmarks/run_serve_h200.sh [qwen2-0.5b] [llama3-8b]
#
# Environment: NUM_REQUESTS (1000), RATES (4,8,16,32,64,inf), both overridable per model with
# the model's name in the variable, - and . as _ (NUM_REQUESTS_llama3_8b, RATES_qwen2_0_5b),
# PORT (8011), INPUT_LEN (128:2048), OUTPUT_LEN (128:512), MAX_MODEL_LEN (4096), SERVE_ARGS
# (extra `pagedcore serve` flags, e.g. --no-engine-process), BENCH_WORKERS (4 client
# processes), GENERATE (1: run the LLM.generate baseline), DEADLINE (epoch seconds: skip what
# would start after it; GENERATE_DEADLINE for the baseline, default DEADLINE), LOW_RATES and
# LOW_NUM_REQUESTS (a second, shorter sweep below saturation into bench_serve_<model>_low.json,
# started before LOW_DEADLINE;
# the plot then shows both). A CPU smoke test of the script: NUM_REQUESTS=4 RATES=inf
# INPUT_LEN=8:16 OUTPUT_LEN=4 MAX_MODEL_LEN=256 SERVE_ARGS="--device cpu" OUT=/tmp/s bash ...
# llama. Results in ${OUT:-docs/benchmarks/serve_h200}/:
#   bench_serve_<model>.json/.png  the sweep (TTFT/TPOT/ITL/e2e percentiles, goodput, errors)
#   generate_<model>.json          LLM.generate on the same requests, and the ratio
#   metrics_<model>.txt            /metrics after the sweep; serve_<model>.log the server log
#   cpu_<model>.json               CPU seconds of the server, its engine process and the client
# Workload: input 128-2,048 tokens, output 128-512 (ignore_eos, greedy). Targets (issue 23):
# throughput at saturation (rate inf) >= 90 % of LLM.generate, TTFT p99 < 1 s below
# saturation, zero errors.
set -u
cd "$(dirname "$0")/../.."
D="${OUT:-docs/benchmarks/serve_h200}"
mkdir -p "$D"
MODELS="${*:-qwen2-0.5b}"
PORT="${PORT:-8011}"
IN="${INPUT_LEN:-128:2048}"
OUTLEN="${OUTPUT_LEN:-128:512}"
MML="${MAX_MODEL_LEN:-4096}"
DEADLINE="${DEADLINE:-9999999999}"
ENGINE_ARGS="--max-model-len $MML --max-num-seqs 256 --max-num-batched-tokens 8192"
cpu() { awk '{print ($14+$15)/100}' "/proc/$1/stat" 2>/dev/null || echo 0; }
rc=0
for m in $MODELS; do
  var="RATES_${m//[-.]/_}"
  RATES="${!var:-${RATES:-4,8,16,32,64,inf}}"
  var="NUM_REQUESTS_${m//[-.]/_}"
  N="${!var:-${NUM_REQUESTS:-1000}}"
  if [ "$(date +%s)" -ge "$DEADLINE" ]; then echo "SKIPPED $m: past the deadline"; continue; fi
  echo "== pagedcore serve random:$m ($(date +%T))"
  # shellcheck disable=SC2086
  pagedcore serve "random:$m" --port "$PORT" $ENGINE_ARGS --max-waiting 4096 \
    --log-level warning ${SERVE_ARGS:-} > "$D/serve_$m.log" 2>&1 &
  pid=$!
  if ! python - "$PORT" "$pid" <<'PY'
import os, sys, time, httpx
port, pid = sys.argv[1], int(sys.argv[2])
deadline = time.monotonic() + 900  # building 8B random weights and CUDA graphs takes a while
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("the server exited; see its log")
    try:
        if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
            sys.exit(0)
    except httpx.HTTPError:
        pass
    time.sleep(0.5)
sys.exit("the server did not come up in 900 s")
PY
  then
    echo "FAILED: pagedcore serve random:$m (log: $D/serve_$m.log)" >&2
    tail -20 "$D/serve_$m.log" >&2
    kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; rc=1; continue
  fi
  child=$(pgrep -P "$pid" -f spawn_main | head -1); child=${child:-$pid}
  echo "== up at $(date +%T); pagedcore bench serve ($N requests at $RATES req/s)"
  s0=$(cpu "$pid"); e0=$(cpu "$child"); t0=$(date +%s.%N)
  TIMEFORMAT="%U %S"
  { time pagedcore bench serve --base-url "http://127.0.0.1:$PORT" --num-requests "$N" \
      --input-len "$IN" --output-len "$OUTLEN" --token-id-range 3:120 --request-rate "$RATES" \
      --slo-ttft-ms 1000 --json "$D/bench_serve_$m.json" --plot "$D/bench_serve_$m.png" \
      --num-workers "${BENCH_WORKERS:-4}" --no-progress > "$D/bench_serve_$m.txt" 2>&1 ; } 2> "$D/client_time_$m.txt" \
    || { echo "FAILED: pagedcore bench serve on $m" >&2; rc=1; }
  cat "$D/bench_serve_$m.txt"
  python - "$D/cpu_$m.json" "$(cpu "$pid")" "$s0" "$(cpu "$child")" "$e0" "$t0" "$D/client_time_$m.txt" <<'PY'
import json, sys, time
out, s1, s0, e1, e0, t0, client = sys.argv[1:]
u, s = (open(client).read().split() + ["0", "0"])[:2]
rep = {"wall_s": time.time() - float(t0), "server_cpu_s": float(s1) - float(s0),
       "engine_process_cpu_s": float(e1) - float(e0), "client_cpu_s": float(u) + float(s)}
json.dump(rep, open(out, "w"), indent=1); print("cpu:", rep)
PY
  if [ -n "${LOW_RATES:-}" ] && [ "$(date +%s)" -lt "${LOW_DEADLINE:-$DEADLINE}" ]; then
    echo "== below saturation: ${LOW_NUM_REQUESTS:-300} requests at $LOW_RATES req/s"
    pagedcore bench serve --base-url "http://127.0.0.1:$PORT" --num-requests "${LOW_NUM_REQUESTS:-300}" \
      --input-len "$IN" --output-len "$OUTLEN" --token-id-range 3:120 --request-rate "$LOW_RATES" \
      --slo-ttft-ms 1000 --json "$D/bench_serve_${m}_low.json" --num-workers "${BENCH_WORKERS:-4}" \
      --no-progress > "$D/bench_serve_${m}_low.txt" 2>&1 || { echo "FAILED: low rates" >&2; rc=1; }
    cat "$D/bench_serve_${m}_low.txt"
    python - "$D/bench_serve_$m.json" "$D/bench_serve_${m}_low.json" "$D/bench_serve_$m.png" <<'PY'
import json, sys
from pagedcore.bench.serve import _plot
runs = [r for path in sys.argv[1:3] for r in json.load(open(path))["runs"]]
_plot(runs, sys.argv[3])
PY
  fi
  python -c "import httpx, sys; open(sys.argv[2], 'w').write(httpx.get(
      f'http://127.0.0.1:{sys.argv[1]}/metrics').text)" "$PORT" "$D/metrics_$m.txt"
  grep -E "^pagedcore:(engine_step|generation_tokens_total)" "$D/metrics_$m.txt"
  kill -TERM "$pid"; wait "$pid"
  if [ "${GENERATE:-1}" != 1 ] || [ "$(date +%s)" -ge "${GENERATE_DEADLINE:-$DEADLINE}" ]; then
    echo "SKIPPED: LLM.generate baseline on $m"; continue
  fi
  echo "== LLM.generate on the same workload ($(date +%T))"
  # shellcheck disable=SC2086
  if ! python - "$m" "$N" "$D/generate_$m.json" "$D/bench_serve_$m.json" "$IN" "$OUTLEN" \
      "$MML" <<'PY'
import json, sys, time
from pagedcore import LLM, SamplingParams
from pagedcore.bench.serve import make_workload
model, n, out, served = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
rng = lambda t: tuple(int(x) for x in (t.split(":") * 2)[:2])
device = "cpu" if "--device cpu" in __import__("os").environ.get("SERVE_ARGS", "") else None
llm = LLM(f"random:{model}", max_model_len=int(sys.argv[7]), max_num_seqs=256,
          max_num_batched_tokens=8192, device=device)
# The same requests as the sweep (same seed and token-id range).
work = make_workload(n, input_len=rng(sys.argv[5]), output_len=rng(sys.argv[6]), seed=0,
                     token_range=(3, 120))
llm.generate([w.prompt for w in work[:8]], SamplingParams(max_tokens=16, ignore_eos=True))
params = [SamplingParams(max_tokens=w.output_len, temperature=0, ignore_eos=True) for w in work]
s0, h0 = llm.num_steps, llm.step_time
t0 = time.perf_counter()
outs = llm.generate([w.prompt for w in work], params)
elapsed = time.perf_counter() - t0
tokens = sum(len(o.outputs[0].token_ids) for o in outs)
report = {"model": model, "requests": n, "elapsed_s": elapsed, "output_tokens": tokens,
          "request_throughput": n / elapsed, "output_throughput": tokens / elapsed,
          "steps": llm.num_steps - s0, "step_time_s": llm.step_time - h0}
try:
    runs = json.load(open(served))["runs"]
    sat = [r for r in runs if r["request_rate"] == "inf"]
    if sat:
        report["serve_over_generate"] = (sat[0]["summary"]["output_throughput"]
                                         / report["output_throughput"])
except OSError:
    pass
json.dump(report, open(out, "w"), indent=2)
print(json.dumps(report, indent=2))
PY
  then
    echo "FAILED: LLM.generate baseline on $m" >&2; rc=1
  fi
done
exit $rc
