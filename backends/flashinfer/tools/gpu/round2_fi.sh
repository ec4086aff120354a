#!/usr/bin/env bash
# Session 12, round 2 on the H200 (issue #21): the Triton decode's split-KV sweep beside
# FlashInfer at 8x32768, then `pagedcore bench engine` with flashinfer (decode CUDA graphs
# declared), triton and cuda_paged forced, with the prefill-heavy stage. No JIT build here:
# FlashInfer's modules come prebuilt (sm_90a, built on a CPU machine with
# backends/flashinfer/tools/prebuild_jit.py) as a tar of aot/<module>/<module>.so in the job's
# extra files (.gpu-extra/fi_aot.tar.xz), unpacked into FlashInfer's data directory.
# Env (the round runner): OUT_DIR, GPU_DEADLINE (epoch s; killed 15 s after it), ROOT_WHL.
set -u
OUT=${OUT_DIR:?}
T0=$(date +%s)
HARD=$(( ${GPU_DEADLINE:-$(( T0 + 75 ))} + 12 ))   # a little before the kill
export PYTHONUNBUFFERED=1 FLASHINFER_CUDA_ARCH_LIST=9.0
mark() { echo "$* (at +$(( $(date +%s) - T0 ))s)" | tee -a "$OUT/steps.txt"; }
left() { echo $(( HARD - $(date +%s) )); }

. backends/flashinfer/tools/gpu/fi_setup.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/gpu.txt" 2>&1

# 1. The split sweep (Triton variants compiled by 10 processes, then timed; FlashInfer beside).
t=$(( $(left) * 2 / 5 )); (( t > 34 )) && t=34; (( t < 20 )) && t=20
if (( t >= 15 )); then
  timeout -k 3 "$t" python3 backends/triton/tools/split_sweep.py "$OUT/split_sweep_h200.json" \
    --shape 8x32768 --flashinfer --seconds $(( t - 4 )) --jobs 10 > "$OUT/split_sweep.log" 2>&1
  mark "split_sweep rc=$? cap=${t}s"
else
  mark "split_sweep skipped: $(left)s left"
fi

# 2. The engine with each backend forced, one process, JSON after every stage.
t=$(left)
if (( t >= 12 )); then
  PAGEDCORE_FLASHINFER_PREFILL=$FI_PREFILL timeout -k 3 "$t" python3 \
    backends/flashinfer/tools/engine_backends.py "$OUT/engine_" flashinfer,triton,cuda_paged \
    --only throughput,prefill --num-prompts 32 --max-new 32 --max-num-seqs 32 --skip-hf \
    --skip-eager > "$OUT/engine.log" 2>&1
  mark "engine rc=$? cap=${t}s (flashinfer prefill kernels: $FI_PREFILL)"
fi
grep -h "engine_backends:" "$OUT/engine.log" >> "$OUT/steps.txt" 2> /dev/null
mark done
