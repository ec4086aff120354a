#!/usr/bin/env bash
# The server on CPU, engine on a thread vs in its own process (issue 23's profiling): a tiny
# random Llama with a null attention (serve_null_attention.py), 256 requests at rate inf,
# REPEATS runs per mode; throughput, TPOT and the CPU seconds of the server process, the
# engine process and the client, into serve_cpu/compare.json.
#   bash docs/benchmarks/serve_cpu/compare.sh
set -u
cd "$(dirname "$0")/../../.."
D=docs/benchmarks/serve_cpu
T=$(mktemp -d)
PORT=${PORT:-8125}
cpu() { awk '{print ($14+$15)/100}' "/proc/$1/stat" 2>/dev/null || echo 0; }
for r in $(seq "${REPEATS:-3}"); do
  for mode in thread process; do
    flag=--engine-process; [ $mode = thread ] && flag=--no-engine-process
    python $D/serve_null_attention.py random:llama --device cpu --backend toy_sdpa --port "$PORT" \
      --max-model-len 512 --max-num-seqs 256 --max-num-batched-tokens 2048 --kv-cache-memory 64MiB \
      --threads 1 --log-level warning --no-log-stats $flag > "$T/log" 2>&1 &
    pid=$!
    until curl -s "localhost:$PORT/health" > /dev/null; do sleep 0.3; done
    child=$(pgrep -P "$pid" -f spawn_main | head -1); child=${child:-$pid}
    pagedcore bench serve --base-url "http://127.0.0.1:$PORT" --num-requests 4 --input-len 16:64 \
      --output-len 4 --token-id-range 3:120 --no-progress > /dev/null 2>&1
    s0=$(cpu $pid); e0=$(cpu $child)
    TIMEFORMAT="%U %S"
    { time pagedcore bench serve --base-url "http://127.0.0.1:$PORT" --num-requests 256 \
        --input-len 16:64 --output-len 64:128 --token-id-range 3:120 --request-rate inf \
        --no-progress --json "$T/$mode-$r.json" > /dev/null 2>&1 ; } 2> "$T/$mode-$r.time"
    echo "$(cpu $pid) $s0 $(cpu $child) $e0 $(cat "$T/$mode-$r.time")" > "$T/$mode-$r.cpu"
    kill -TERM $pid; wait $pid
  done
done
python - "$T" "$D/compare.json" "${REPEATS:-3}" <<'PY'
import json, subprocess, sys
t, out, reps = sys.argv[1], sys.argv[2], int(sys.argv[3])
rows = []
for r in range(1, reps + 1):
    for mode in ("thread", "process"):
        s = json.load(open(f"{t}/{mode}-{r}.json"))["runs"][0]["summary"]
        s1, s0, e1, e0, u, sy = map(float, open(f"{t}/{mode}-{r}.cpu").read().split())
        server = s1 - s0
        engine = e1 - e0 if mode == "process" else 0.0
        rows.append({"mode": mode, "repeat": r, "output_throughput": s["output_throughput"],
                     "tpot_p50_ms": s["tpot_ms"]["p50"], "errors": s["errors"],
                     "server_process_cpu_s": server, "engine_process_cpu_s": engine,
                     "client_cpu_s": u + sy, "output_tokens": s["output_tokens"]})
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                        text=True).stdout.strip()
json.dump({"command": "bash docs/benchmarks/serve_cpu/compare.sh", "commit": commit,
           "note": "2 shared CPU cores: wall-clock figures are noisy, CPU seconds less so",
           "rows": rows}, open(out, "w"), indent=1)
for row in rows:
    print(row)
PY
rm -rf "$T"
