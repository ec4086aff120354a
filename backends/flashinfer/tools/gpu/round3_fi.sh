#!/usr/bin/env bash
# Session 12, round 3 (the last) on the H200 (issue #21):
# 1. `pagedcore bench kernels --backend triton --backend flashinfer --backend cuda_paged
#    --case decode`: the backends side by side in one run, eager and CUDA-graph rows, with the
#    Triton decode's split-KV default kept from round 2's sweep (none of the swept plans beat it);
# 2. in the time left, `pagedcore bench engine --only prefill` with cuda_paged, triton and
#    flashinfer forced (round 2 found cuda_paged 1.76x triton there: a second run, with each
#    prompt's greedy first token recorded, so the backends' outputs can be compared).
# FlashInfer's modules come prebuilt (fi_setup.sh); the Triton decode kernels are compiled
# ahead, in parallel with that. Env: OUT_DIR, GPU_DEADLINE, ROOT_WHL.
set -u
OUT=${OUT_DIR:?}
T0=$(date +%s)
HARD=$(( ${GPU_DEADLINE:-$(( T0 + 45 ))} + 12 ))   # a little before the kill
export PYTHONUNBUFFERED=1 FLASHINFER_CUDA_ARCH_LIST=9.0
mark() { echo "$* (at +$(( $(date +%s) - T0 ))s)" | tee -a "$OUT/steps.txt"; }
left() { echo $(( HARD - $(date +%s) )); }
# The Triton decode kernels of the three shapes compile (3 processes) while FlashInfer is set up.
python3 backends/triton/tools/split_sweep.py /dev/null --compile-only --variant default \
  --shape 64x4096 --shape 8x32768 --shape 256x1024 --jobs 3 > "$OUT/precompile.log" 2>&1 &
pc=$!
. backends/flashinfer/tools/gpu/fi_setup.sh
wait "$pc"
mark "precompile rc=$?"
# What the selector picks now, and why (beside the bench: it only reads the declarations).
( python3 -m pagedcore.cli select --head-size 128 --explain > "$OUT/select_explain.txt" 2>&1
  python3 -m pagedcore.cli select --head-size 64 --explain > "$OUT/select_explain_hs64.txt" 2>&1
) &
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/gpu.txt" 2>&1
t=$(( $(left) - 14 )); (( t > 36 )) && t=36
timeout -k 3 "$t" python3 -m pagedcore.cli bench kernels --backend triton --backend flashinfer \
  --backend cuda_paged --case decode --json "$OUT/kernels_decode_h200.json" \
  > "$OUT/kernels.log" 2>&1
mark "bench kernels rc=$? cap=${t}s"
t=$(left)
if (( t >= 8 )); then
  timeout -k 3 "$t" python3 backends/flashinfer/tools/engine_backends.py "$OUT/engine_prefill_" \
    cuda_paged,triton,flashinfer --only prefill --skip-hf --enforce-eager > "$OUT/engine_prefill.log" 2>&1
  mark "engine prefill rc=$? cap=${t}s (flashinfer prefill kernels: $FI_PREFILL)"
fi
grep -h "engine_backends:" "$OUT/engine_prefill.log" >> "$OUT/steps.txt" 2> /dev/null
wait
mark done
