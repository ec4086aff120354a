#!/bin/bash
# Issue 9 on one GPU, in ~100 s: prefix caching (1K/4K/16K system prompts + multi-turn chat, a
# per-phase breakdown and torch-profiler tables of cold and warm requests) and chunked prefill
# (32K-token long prompt + 20 shorts, threshold and budget sweeps, one engine for the sweep).
#   bash docs/benchmarks/run_exp_h200.sh RESULT_DIR     (from the repo root, pagedcore and
#                                                        pagedcore-triton installed)
#   EXP_CPU=1 bash docs/benchmarks/run_exp_h200.sh DIR  (CPU dry run: --small, reference backend)
# RESULT_DIR/{prefix,chunked}.{json,png} have the format of docs/benchmarks/h200_s3_exp/;
# every step has its own timeout (EXP_CAP seconds in all, default 145) and prints KEY lines.
R=${1:?usage: bash docs/benchmarks/run_exp_h200.sh RESULT_DIR}; mkdir -p "$R"
export PYTHONUNBUFFERED=1
T0=$(date +%s)
CAP=${EXP_CAP:-145}
left() { echo $(( CAP - ($(date +%s) - T0) )); }
el() { echo "[exp +$(( $(date +%s) - T0 ))s] $*"; }
if [ -n "${EXP_CPU:-}" ]; then
  DEV="--small --device cpu --backend reference"; LENS=1024,4096
  CH="--long-len 4096 --budgets 512 --thresholds 256,1024"
else
  DEV="--backend triton"; LENS=1024,4096,16384
  CH="--budgets 2048,8192 --thresholds 1024,2048,4096,1536,3072,768,512 --reps 2"
fi
el "1. bench prefix ($LENS)"
timeout --kill-after=3 75 python3 -m pagedcore.cli bench prefix $DEV --lengths $LENS --reps 3 \
  --profile-dir "$R/profiles" --json "$R/prefix.json" --plot "$R/prefix.png" 2>&1 | grep -v "^\s*$"
el "prefix rc=${PIPESTATUS[0]}"
T=$(( $(left) - 3 ))
el "2. bench chunked (timeout ${T}s)"
if [ "$T" -gt 15 ]; then
  timeout --kill-after=3 $T python3 -m pagedcore.cli bench chunked $DEV $CH \
    --json "$R/chunked.json" --plot "$R/chunked.png" 2>&1 | grep -v "^\s*$"
  el "chunked rc=${PIPESTATUS[0]}"
else
  el "skipped chunked: only ${T}s left"
fi
ls -la "$R"
