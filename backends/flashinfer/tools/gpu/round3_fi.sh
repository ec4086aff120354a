#!/usr/bin/env bash
# Session 12, round 3 on the H200 (issue #21): `pagedcore bench kernels --backend triton
# --backend flashinfer --case decode`, both backends in one run (eager and CUDA-graph rows),
# with the Triton decode's split-KV default chosen from round 2's sweep; then, in the time
# left, `pagedcore bench engine` with flex forced (a short workload: its kernels compile per
# shape bucket). FlashInfer's modules come prebuilt (fi_setup.sh).
# Env (the round runner): OUT_DIR, GPU_DEADLINE, ROOT_WHL.
set -u
OUT=${OUT_DIR:?}
T0=$(date +%s)
HARD=$(( ${GPU_DEADLINE:-$(( T0 + 45 ))} + 12 ))   # a little before the kill
export PYTHONUNBUFFERED=1 FLASHINFER_CUDA_ARCH_LIST=9.0
mark() { echo "$* (at +$(( $(date +%s) - T0 ))s)" | tee -a "$OUT/steps.txt"; }
left() { echo $(( HARD - $(date +%s) )); }
. backends/flashinfer/tools/gpu/fi_setup.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/gpu.txt" 2>&1
t=$(( $(left) - 12 )); (( t > 40 )) && t=40
timeout -k 3 "$t" python3 -m pagedcore.cli bench kernels --backend triton --backend flashinfer \
  --case decode --json "$OUT/kernels_decode_triton_flashinfer_h200.json" > "$OUT/kernels.log" 2>&1
mark "bench kernels rc=$? cap=${t}s"
t=$(left)
if (( t >= 10 )); then
  timeout -k 3 "$t" python3 backends/flashinfer/tools/engine_backends.py "$OUT/engine_" flex \
    --only throughput --num-prompts 8 --max-new 8 --max-num-seqs 8 --skip-hf --skip-eager \
    > "$OUT/engine_flex.log" 2>&1
  mark "engine flex rc=$? cap=${t}s"
fi
mark done
