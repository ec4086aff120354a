#!/bin/bash
# Round 1 of the Hopper prefill kernel on the H200 (cap 130 s): bash tools/tma_gpu_round1.sh OUT
# Correctness (NaN-poisoned ragged batch vs float64), then timing of the tile variants at
# 4x2048 / 4x8192 next to SDPA and the gather kernel, the mixed step, the prefill
# conformance cases (see tools/tma_variants.py). Run from the repository root. Each variant
# is compiled in a process of its own beside the main one (Triton's on-disk cache).
set -u
OUT=${1:?usage: tma_gpu_round1.sh OUT}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T=backends/triton/tools/tma_variants.py
VARIANTS="default 128,128,8,3,d32 128,64,8,3 128,64,8,3,d32 128,128,8,2 64,64,4,2 64,32,4,3 256,64,8,2 128,128,8,3,e1"
i=0
for v in gather $VARIANTS; do
  timeout -k 2 60 python3 $T --warm "$v" > "$OUT/warm_$i.log" 2>&1 &
  i=$((i + 1))
done
python3 $T "$OUT" --budget "${BUDGET:-100}" $VARIANTS
wait
cat "$OUT"/warm_*.log | grep -v "^$" | tail -20
