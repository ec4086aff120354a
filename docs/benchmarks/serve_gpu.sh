#!/usr/bin/env bash
# Issue 23 on the H200 in one capped device round: `pagedcore serve` at its default
# --stream-interval 1 against `LLM.generate` on the issue's workload (1,000 requests, input
# 128-2,048, output 128-512), then rates below saturation with fresh prompts (a seed of their
# own per rate: no prefix-cache reuse of the saturation run's prompts). Runs
# docs/benchmarks/run_serve_h200.sh per model, in the order of SERVE_MODELS, each step started
# only when the time left (GPU_DEADLINE, epoch seconds) can hold it and run under `timeout`.
#
#   OUT_DIR=/tmp/o GPU_DEADLINE=$(( $(date +%s) + 240 )) bash docs/benchmarks/serve_gpu.sh
#
# Environment: OUT_DIR (results: OUT_DIR/<model>/), GPU_DEADLINE, SERVE_MODELS (default
# "llama3-8b qwen2-0.5b"), SERVE_ARGS (extra `pagedcore serve` flags; default none: stream
# interval 1), LOW_RATES_<model> / LOW_N_<model> (the rates below saturation and their request
# counts). CPU smoke test (tiny shapes, `random:llama`):
#   SMOKE=1 OUT_DIR=/tmp/o bash docs/benchmarks/serve_gpu.sh
set -u
[ -f docs/benchmarks/run_serve_h200.sh ] || cd "$(dirname "$0")/../.."  # the round runs a copy from the root
T0=$(date +%s)
OUT_DIR="${OUT_DIR:-/tmp/serve_gpu}"
GPU_DEADLINE="${GPU_DEADLINE:-$((T0 + 240))}"
END=$((GPU_DEADLINE - 8))  # killed 15 s after GPU_DEADLINE: keep a margin for the copy-out
mkdir -p "$OUT_DIR"
echo "serve_gpu.sh at ${PAGEDCORE_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}, $(( GPU_DEADLINE - T0 )) s to the deadline"
python - <<'PY' || { echo "FAILED: the web stack is not importable"; exit 1; }
import importlib
for m in ("fastapi", "uvicorn", "httpx", "prometheus_client", "pydantic", "matplotlib"):
    try:
        mod = importlib.import_module(m)
        print(m, getattr(mod, "__version__", "?"))
    except ImportError as exc:
        print("MISSING", m, exc)
        if m != "matplotlib":
            raise
PY
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
rc=0
# Per model, seconds on the H200 (earlier rounds): the baseline (the first LLM build of a
# fresh machine compiles the Triton kernels: ~45 s for Llama-3-8B, then ~64 s for 320k output
# tokens at ~5,000 tok/s; Qwen2-0.5B ~35 s + ~10 s at ~34,000), the server's start (compiles
# cached by then) and the rate-inf run of 1,000 requests.
declare -A GEN_S=([llama3-8b]=110 [qwen2-0.5b]=50 [llama]=10)
declare -A UP_S=([llama3-8b]=25 [qwen2-0.5b]=25 [llama]=10)
declare -A UP_COLD_S=([llama3-8b]=50 [qwen2-0.5b]=40 [llama]=10)
declare -A INF_S=([llama3-8b]=72 [qwen2-0.5b]=14 [llama]=10)
declare -A LOWR=([llama3-8b]=8 [qwen2-0.5b]=8,32,16 [llama]=4)
declare -A LOWN=([llama3-8b]=48 [qwen2-0.5b]=120,240,160 [llama]=4)
# Seconds one low-rate run needs (arrivals, then the last request's up to 512 tokens).
declare -A LOWT=([llama3-8b]=12 [qwen2-0.5b]=16 [llama]=10)
if [ -n "${SMOKE:-}" ]; then
  MODELS="llama"
  export INPUT_LEN=8:16 OUTPUT_LEN=4:8 MAX_MODEL_LEN=256 SERVE_ARGS="--device cpu ${SERVE_ARGS:-}"
  export BENCH_WORKERS=2
  N=8
else
  MODELS="${SERVE_MODELS:-llama3-8b qwen2-0.5b}"
  N=1000
fi
for m in $MODELS; do
  now=$(date +%s)
  v="LOW_RATES_${m//[-.]/_}"; low_rates="${!v:-${LOWR[$m]}}"
  v="LOW_N_${m//[-.]/_}"; low_n="${!v:-${LOWN[$m]}}"
  need=$(( UP_S[$m] + INF_S[$m] + GEN_S[$m] ))
  gen=1
  if [ $((END - now)) -lt "$need" ]; then
    # No time for the baseline: the server alone, if its start (compiling, as the first build
    # of this shape) and the rate-inf run fit; its JSON says no baseline ran beside it.
    need=$(( UP_COLD_S[$m] + INF_S[$m] ))
    if [ $((END - now)) -lt "$need" ]; then
      echo "SKIPPED $m: $((END - now)) s left, it needs ~$need s"; continue
    fi
    gen=0
    echo "== $m: no time for the LLM.generate baseline; the server alone"
  fi
  # The baseline first (a round cut short loses the tail of the sweep, not the ratio); the
  # server only if its start and the rate-inf run still fit; each low rate while the time it needs is left.
  echo "== $m at $(date +%T): $((END - now)) s left; low rates $low_rates ($low_n requests)"
  OUT="$OUT_DIR/$m" NUM_REQUESTS=$N RATES=inf LOW_RATES="$low_rates" LOW_NUM_REQUESTS="$low_n" \
    LOW_SEED=1 GENERATE_FIRST=1 GENERATE=$gen GENERATE_DEADLINE="$((END - need))" \
    DEADLINE="$((END - (gen ? UP_S[$m] : UP_COLD_S[$m]) - INF_S[$m]))" LOW_DEADLINE="$((END - LOWT[$m]))" \
    HARD_DEADLINE="$END" bash docs/benchmarks/run_serve_h200.sh "$m" || rc=1
  echo "== $m done at +$(( $(date +%s) - T0 )) s"
done
# What the committed results need besides the JSON: sizes, so nothing over the limit.
du -sh "$OUT_DIR" 2>/dev/null
echo "serve_gpu.sh elapsed $(( $(date +%s) - T0 )) s, rc=$rc"
exit $rc
