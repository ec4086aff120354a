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
# processes), GENERATE (1: run the LLM.generate baseline), GENERATE_FIRST (1: the baseline
# before the server, so that a round cut short loses the sweep's tail, not the ratio), DEADLINE (epoch seconds: skip what
# would start after it; GENERATE_DEADLINE for the baseline, default DEADLINE), LOW_RATES and
# LOW_NUM_REQUESTS (a second, shorter sweep below saturation into bench_serve_<model>_low.json,
# started before LOW_DEADLINE; the plot then shows both: each rate is its own run with prompts
# of its own, seed LOW_SEED (1) + its position, so none repeats a prompt of the rate-inf run
# (seed 0) or of another rate and the prefix cache does not flatter TTFT; LOW_NUM_REQUESTS may
# be a comma list, one count per rate), HARD_DEADLINE (epoch seconds: every step runs under
# `timeout` so that none runs past it; a step cut short leaves what it wrote before). A CPU smoke test of the script: NUM_REQUESTS=4 RATES=inf
# INPUT_LEN=8:16 OUTPUT_LEN=4 MAX_MODEL_LEN=256 SERVE_ARGS="--device cpu" OUT=/tmp/s bash ...
# llama. Results in ${OUT:-docs/benchmarks/serve_h200}/:
#   bench_serve_<model>.json/.png  the sweep (TTFT/TPOT/ITL/e2e percentiles, goodput, errors)
#   generate_<model>.json          LLM.generate on the same requests, and the ratio
#   metrics_<model>.txt            /metrics after the sweep; serve_<model>.log the server log
#   cpu_<model>.json               CPU seconds of the server, its engine process and the client;
#                                  the engine loop's phases over the rate-inf run (step trace)
#   step_trace_<model>.jsonl       the engine loop's timeline (PAGEDCORE_STEP_TRACE)
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
HARD="${HARD_DEADLINE:-9999999999}"
left() { local l=$((HARD - $(date +%s))); [ "$l" -gt 1 ] && echo "$l" || echo 1; }
ENGINE_ARGS="--max-model-len $MML --max-num-seqs 256 --max-num-batched-tokens 8192"
cpu() { awk '{print ($14+$15)/100}' "/proc/$1/stat" 2>/dev/null || echo 0; }
# LLM.generate on the same workload (model $m, $N requests) into generate_$m.json, with the
# ratio to the served rate-inf run when that ran already (else `ratio` adds it later).
baseline() {
  if [ "${GENERATE:-1}" != 1 ] || [ "$(date +%s)" -ge "${GENERATE_DEADLINE:-$DEADLINE}" ]; then
    echo "SKIPPED: LLM.generate baseline on $m"; return
  fi
  echo "== LLM.generate on the same workload ($(date +%T))"
  # shellcheck disable=SC2086
  if ! timeout "$(left)" python - "$m" "$N" "$D/generate_$m.json" "$D/bench_serve_$m.json" "$IN" "$OUTLEN" \
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
report = {"model": model, "commit": __import__("os").environ.get("PAGEDCORE_GIT_COMMIT"),
          "requests": n, "elapsed_s": elapsed, "output_tokens": tokens,
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
}
ratio() {
  python - "$D/generate_$m.json" "$D/bench_serve_$m.json" <<'PY'
import json, os, sys
gen, served = sys.argv[1:]
if os.path.exists(gen) and os.path.exists(served):
    report = json.load(open(gen))
    sat = [r for r in json.load(open(served))["runs"] if r["request_rate"] == "inf"]
    if sat:
        report["serve_over_generate"] = (sat[0]["summary"]["output_throughput"]
                                         / report["output_throughput"])
        json.dump(report, open(gen, "w"), indent=2)
        print(f"serve / generate at saturation: {report['serve_over_generate']:.3f}")
PY
}
# Plots need matplotlib; without it the JSON still comes (plot it elsewhere from the JSON).
HAVE_PLOT=1
python -c "import matplotlib" 2>/dev/null || { HAVE_PLOT=0; echo "matplotlib missing: no plots"; }
rc=0
for m in $MODELS; do
  var="RATES_${m//[-.]/_}"
  RATES="${!var:-${RATES:-4,8,16,32,64,inf}}"
  var="NUM_REQUESTS_${m//[-.]/_}"
  N="${!var:-${NUM_REQUESTS:-1000}}"
  if [ "$(date +%s)" -ge "$DEADLINE" ]; then echo "SKIPPED $m: past the deadline"; continue; fi
  [ "${GENERATE_FIRST:-0}" = 1 ] && baseline
  if [ "$(date +%s)" -ge "$DEADLINE" ]; then echo "SKIPPED serving $m: past the deadline"; continue; fi
  echo "== pagedcore serve random:$m ($(date +%T))"
  # shellcheck disable=SC2086
  rm -f "$D/step_trace_$m.jsonl"
  PAGEDCORE_STEP_TRACE="$D/step_trace_$m.jsonl" \
  pagedcore serve "random:$m" --port "$PORT" $ENGINE_ARGS --max-waiting 4096 \
    --log-level warning ${SERVE_ARGS:-} > "$D/serve_$m.log" 2>&1 &
  pid=$!
  if ! timeout "$(left)" python - "$PORT" "$pid" <<'PY'
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
    # The engine process too: one still building would hold the GPU the next step needs.
    child=$(pgrep -P "$pid" -f spawn_main | head -1)
    kill "$pid" 2>/dev/null; [ -n "$child" ] && kill -KILL "$child" 2>/dev/null
    wait "$pid" 2>/dev/null; rc=1; continue
  fi
  child=$(pgrep -P "$pid" -f spawn_main | head -1); child=${child:-$pid}
  echo "== up at $(date +%T); pagedcore bench serve ($N requests at $RATES req/s)"
  # The engine's own steps during this run (its /metrics counters before and after): how much
  # of the run's wall time the engine spent inside steps, i.e. whether it ever waited.
  steps() { curl -s "http://127.0.0.1:$PORT/metrics" \
    | awk '/^pagedcore:engine_steps_total/{n=$2} /^pagedcore:engine_step_seconds_total/{s=$2} END{print n+0, s+0}'; }
  m0=$(steps)
  s0=$(cpu "$pid"); e0=$(cpu "$child"); t0=$(date +%s.%N)
  TIMEFORMAT="%U %S"
  { time timeout "$(left)" pagedcore bench serve --base-url "http://127.0.0.1:$PORT" --num-requests "$N" \
      --input-len "$IN" --output-len "$OUTLEN" --token-id-range 3:120 --request-rate "$RATES" \
      --slo-ttft-ms 1000 --json "$D/bench_serve_$m.json" \
      $( [ "$HAVE_PLOT" = 1 ] && echo --plot "$D/bench_serve_$m.png" ) \
      --num-workers "${BENCH_WORKERS:-4}" --no-progress > "$D/bench_serve_$m.txt" 2>&1 ; } 2> "$D/client_time_$m.txt" \
    || { echo "FAILED: pagedcore bench serve on $m" >&2; rc=1; }
  cat "$D/bench_serve_$m.txt"
  sleep 0.5  # the engine loop flushes its step trace once idle
  python - "$D/cpu_$m.json" "$(cpu "$pid")" "$s0" "$(cpu "$child")" "$e0" "$t0" "$D/client_time_$m.txt" "$m0" "$(steps)" \
      "$D/step_trace_$m.jsonl" "$D/bench_serve_$m.json" <<'PY'
import json, os, sys, time
out, s1, s0, e1, e0, t0, client, m0, m1, trace, served = sys.argv[1:]
u, s = (open(client).read().split() + ["0", "0"])[:2]
rep = {"wall_s": time.time() - float(t0), "server_cpu_s": float(s1) - float(s0),
       "engine_process_cpu_s": float(e1) - float(e0), "client_cpu_s": float(u) + float(s)}
(n0, x0), (n1, x1) = (map(float, m.split()) for m in (m0, m1))
rep["engine_steps"], rep["engine_step_s"] = int(n1 - n0), x1 - x0
# The engine loop's timeline over the rate-inf run (pagedcore.serve.step_trace), with the
# client's clock: when it sent its first and last requests and got its first and last tokens.
if os.path.exists(trace) and os.path.exists(served):
    from pagedcore.serve.step_trace import read, summarize
    runs = [r for r in json.load(open(served))["runs"] if r["request_rate"] == "inf"]
    clock = runs[0]["summary"].get("clock") if runs else None
    if clock and clock.get("first_send") is not None:
        rep["client_clock"] = clock
        rep["engine_trace"] = summarize(read(trace), clock["first_send"], clock["last_token"])
json.dump(rep, open(out, "w"), indent=1); print("cpu:", rep)
PY
  if [ -n "${LOW_RATES:-}" ] && [ "$(date +%s)" -lt "${LOW_DEADLINE:-$DEADLINE}" ]; then
    IFS=, read -r -a low_rates <<< "$LOW_RATES"
    IFS=, read -r -a low_counts <<< "${LOW_NUM_REQUESTS:-300}"
    low_files=()
    for i in "${!low_rates[@]}"; do
      r=${low_rates[$i]}; n=${low_counts[$i]:-${low_counts[-1]}}; seed=$(( ${LOW_SEED:-1} + i ))
      if [ "$(date +%s)" -ge "${LOW_DEADLINE:-$DEADLINE}" ]; then
        echo "SKIPPED: $m at $r req/s (past the deadline)"; continue
      fi
      echo "== below saturation: $n requests at $r req/s, fresh prompts (seed $seed, $(date +%T))"
      f="$D/bench_serve_${m}_low_$r.json"
      timeout "$(left)" pagedcore bench serve --base-url "http://127.0.0.1:$PORT" --num-requests "$n" \
        --input-len "$IN" --output-len "$OUTLEN" --token-id-range 3:120 --request-rate "$r" \
        --seed "$seed" --slo-ttft-ms 1000 --json "$f" --num-workers "${BENCH_WORKERS:-4}" \
        --no-progress > "$D/bench_serve_${m}_low_$r.txt" 2>&1 \
        || { echo "FAILED: $m at $r req/s" >&2; rc=1; }
      cat "$D/bench_serve_${m}_low_$r.txt"
      [ -s "$f" ] && low_files+=("$f")
    done
    # One file with every low rate's run (each keeps its seed), and the plot with all rates.
    HAVE_PLOT=$HAVE_PLOT python - "$D/bench_serve_$m.json" "$D/bench_serve_${m}_low.json" "$D/bench_serve_$m.png" \
        "${low_files[@]}" <<'PY'
import json, os, sys
from pagedcore.bench.serve import _plot
main_path, low_path, png, lows = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
low_runs = []
for path in lows:
    rep = json.load(open(path))
    for run in rep["runs"]:
        run["seed"], run["num_requests"] = rep.get("seed"), rep.get("num_requests")
        low_runs.append(run)
if lows:
    merged = dict(json.load(open(lows[0])), runs=low_runs, files=[os.path.basename(p) for p in lows])
    json.dump(merged, open(low_path, "w"), indent=1)
main_runs = json.load(open(main_path))["runs"] if os.path.exists(main_path) else []
if (main_runs or low_runs) and os.environ.get("HAVE_PLOT") == "1":
    _plot(main_runs + low_runs, png)
PY
  fi
  timeout 20 python -c "import httpx, sys; open(sys.argv[2], 'w').write(httpx.get(
      f'http://127.0.0.1:{sys.argv[1]}/metrics').text)" "$PORT" "$D/metrics_$m.txt"
  grep -E "^pagedcore:(engine_step|generation_tokens_total)" "$D/metrics_$m.txt"
  # Graceful stop, bounded: whatever is still in flight after 15 s is killed (the engine
  # process too), so the GPU is free for the baseline.
  kill -TERM "$pid"
  for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
  kill -KILL "$pid" "$child" 2>/dev/null; wait "$pid" 2>/dev/null
  if [ "${GENERATE_FIRST:-0}" = 1 ]; then ratio; else baseline; fi
done
exit $rc
