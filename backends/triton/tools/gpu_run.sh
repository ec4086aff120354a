#!/bin/bash
# The Triton backend's GPU job (one H200, ~60-90 s): bash backends/triton/tools/gpu_run.sh OUT_DIR
#  1. CUDA-graph capture/replay of forward vs a float64 formula (graph.json),
#  2. the kernel bench: decode (eager and CUDA graph), prefill, mixed (kernels_triton_h200.json),
#  3. the prefill tile variants (prefill.json); `warm` compiles them beside step 1.
# Each step has its own timeout and writes its JSON as it goes.
R=${1:?usage: backends/triton/tools/gpu_run.sh OUT_DIR}
mkdir -p "$R"
export PYTHONUNBUFFERED=1
T=backends/triton/tools/gpu_check.py
t0=$(date +%s)
el() { echo "== $1 at +$(( $(date +%s) - t0 ))s"; }
timeout -k 2 45 python3 $T warm "$R" > "$R/warm.log" 2>&1 &
WARM=$!
el graph; timeout -k 2 30 python3 $T graph "$R"
el bench; timeout -k 2 50 python3 -m pagedcore.cli bench kernels --backend triton \
  --json "$R/kernels_triton_h200.json" 2>&1 | tail -30
wait $WARM; echo "warm rc=$?"; tail -2 "$R/warm.log"
el prefill; timeout -k 2 35 python3 $T prefill "$R"
el end
