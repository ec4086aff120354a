#!/bin/bash
# The Hopper prefill default on the H200 (~60 s): bash tools/tma_gpu_round2.sh OUT
#  1. in parallel: the full triton conformance suite in 16 shards (conformance_shards.py; merge
#     them afterwards with `conformance_shards.py OUT merge triton`) and
#     the compiles of the bench's prefill and mixed launches (tma_variants.py --warm*),
#  2. then, alone on the GPU: pagedcore bench kernels --backend triton --case prefill
#     --case mixed (SDPA on contiguous K/V in the same run is the ceiling).
# Run from the repository root.
set -u
OUT=${1:?usage: tma_gpu_round2.sh OUT}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
T=backends/triton/tools
S=${SHARDS:-16}
for i in $(seq 0 $((S - 1))); do
  timeout -k 1 "${CONF_CAP:-40}" python3 $T/conformance_shards.py "$OUT" $S $i triton > "$OUT/shard_$i.log" 2>&1 &
done
timeout -k 2 "${CONF_CAP:-40}" python3 $T/tma_variants.py --warm default > "$OUT/warm_0.log" 2>&1 &
timeout -k 2 "${CONF_CAP:-40}" python3 $T/tma_variants.py --warm-mixed > "$OUT/warm_1.log" 2>&1 &
wait
echo "== conformance and warm done at +$(( $(date +%s) - t0 ))s"
cat "$OUT"/warm_*.log
timeout -k 2 "${BENCH_CAP:-40}" python3 -m pagedcore.cli bench kernels --backend triton --case prefill \
  --case mixed --json "$OUT/kernels_triton_h200.json" 2>&1 | tail -12
echo "== bench done at +$(( $(date +%s) - t0 ))s"
