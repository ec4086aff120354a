#!/bin/bash
# Issue 9 on one GPU: prefix caching (1K/4K/16K system prompts + multi-turn chat, a per-phase
# breakdown) and chunked prefill (32K-token long prompt + 20 shorts, threshold and budget sweeps,
# one engine for the sweep), for the Llama-3-8B shape and/or the Qwen2-0.5B shape.
#   bash docs/benchmarks/run_exp_h200.sh RESULT_DIR [STEPS]   (from the repo root, pagedcore and
#                                                              pagedcore-triton installed)
#   EXP_CPU=1 bash docs/benchmarks/run_exp_h200.sh DIR [STEPS] (CPU dry run: --small, reference)
# STEPS: comma list, run in this order, each under its own timeout, a step skipped when less than
# its minimum time is left of EXP_CAP (seconds, default 165):
#   prefix8b    bench prefix  --model llama3-8b   -> prefix_8b.{json,png}      (~75 s, 43 s of it
#                                                    building the first engine)
#   chunked8b   bench chunked --model llama3-8b   -> chunked_8b.{json,png}     (~95 s, 12 configs)
#   prefix05b   bench prefix  (Qwen2-0.5B)        -> prefix.{json,png}         (~50 s, no profiles)
#   chunked05b  bench chunked (Qwen2-0.5B)        -> chunked.{json,png}        (~45 s)
# Default STEPS: prefix8b,chunked8b,prefix05b. EXP_CHUNKED_REPS (default 1), EXP_THRESHOLDS,
# EXP_PAIRS (THR:MNBT) and EXP_BUDGETS override the 8B chunked sweep. chunked JSON is rewritten after
# every configuration, so a step cut short keeps what it measured. KEY lines are the results.
R=${1:?usage: bash docs/benchmarks/run_exp_h200.sh RESULT_DIR [STEPS]}; mkdir -p "$R"
STEPS=${2:-prefix8b,chunked8b,prefix05b}
export PYTHONUNBUFFERED=1
T0=$(date +%s)
CAP=${EXP_CAP:-165}
left() { echo $(( CAP - ($(date +%s) - T0) )); }
el() { echo "[exp +$(( $(date +%s) - T0 ))s] $*"; }
if [ -n "${EXP_CPU:-}" ]; then
  DEV="--small --device cpu --backend reference"; LENS=1024,4096
  CH8="--long-len 2048 --budgets 512 --thresholds 256,1024 --pairs 384:512 --reps 1"
  CH05="--long-len 2048 --budgets 512 --thresholds 256 --reps 1"
else
  DEV="--backend triton"; LENS=1024,4096,16384
  CH8="--thresholds ${EXP_THRESHOLDS:-480,512,992,1024,2048,4096,256}"
  CH8="$CH8 --pairs ${EXP_PAIRS:-384:512,1536:2048}"
  CH8="$CH8 --budgets ${EXP_BUDGETS:-2048,8192} --reps ${EXP_CHUNKED_REPS:-1}"
  CH05="--budgets 2048,8192 --thresholds 1024,2048,4096,1536,3072,768,512 --reps 2"
fi
# step NAME MIN_S MAX_S ARGS...: run `pagedcore bench ARGS` under min(MAX_S, time left - 2).
step() {
  local name=$1 min=$2 max=$3; shift 3
  local t=$(( $(left) - 2 )); [ "$t" -gt "$max" ] && t=$max
  if [ "$t" -lt "$min" ]; then el "skip $name: only ${t}s left (needs ${min}s)"; return; fi
  el "$name (timeout ${t}s): bench $*"
  timeout --kill-after=3 "$t" python3 -m pagedcore.cli bench "$@" 2>&1 | grep -v "^\s*$"
  el "$name rc=${PIPESTATUS[0]}"
}
IFS=, read -ra LIST <<< "$STEPS"
for s in "${LIST[@]}"; do
  case $s in
    prefix8b) step prefix8b 30 150 prefix $DEV --model llama3-8b --lengths $LENS --reps 3 \
                --json "$R/prefix_8b.json" --plot "$R/prefix_8b.png" ;;
    chunked8b) step chunked8b 30 150 chunked $DEV --model llama3-8b $CH8 \
                 --json "$R/chunked_8b.json" --plot "$R/chunked_8b.png" ;;
    prefix05b) step prefix05b 30 60 prefix $DEV --lengths $LENS --reps 3 \
                 --json "$R/prefix.json" --plot "$R/prefix.png" ;;
    chunked05b) step chunked05b 40 90 chunked $DEV $CH05 \
                  --json "$R/chunked.json" --plot "$R/chunked.png" ;;
    *) el "unknown step $s (prefix8b, chunked8b, prefix05b, chunked05b)" ;;
  esac
done
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>/dev/null
ls -la "$R"
