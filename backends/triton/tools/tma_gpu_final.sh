#!/bin/bash
# The Hopper prefill default through the shipped bench, on the H200 (issue 26; a 60 s cap):
#   OUT_DIR=... GPU_DEADLINE=... bash backends/triton/tools/tma_gpu_final.sh
# 1. in parallel: the full triton conformance suite in 16 shards (conformance_shards.py;
#    merged at the end into conformance_triton_summary.json) and the compiles of the bench's
#    prefill and mixed launches (tma_variants.py --warm / --warm-mixed),
# 2. then, alone on the GPU: pagedcore bench kernels --backend triton --case prefill --case
#    mixed (torch SDPA on contiguous K/V in the same run) -> kernels_triton_h200.json,
# 3. with the time left: tma_variants.py --steps time on $VARIANTS (default: the default and
#    the previous default) -> time.json, a second sample of the ratios.
# Run from the repository root.
set -u
OUT=${OUT_DIR:?OUT_DIR}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
DEADLINE=${GPU_DEADLINE:-$(( $(date +%s) + 58 ))}
left() { echo $(( DEADLINE - $(date +%s) )); }
L0=$(left)
t0=$(date +%s)
T=backends/triton/tools
echo "tiles override: ${PAGEDCORE_TRITON_TMA_TILES:-none}" | tee "$OUT/log.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >> "$OUT/log.txt" 2>&1
C=$(( L0 * 45 / 100 ))
for i in $(seq 0 15); do
  timeout -k 1 "$C" python3 $T/conformance_shards.py "$OUT" 16 "$i" triton > "$OUT/shard_$i.log" 2>&1 &
done
timeout -k 2 "$C" python3 $T/tma_variants.py --warm default > "$OUT/warm_0.log" 2>&1 &
timeout -k 2 "$C" python3 $T/tma_variants.py --warm-mixed > "$OUT/warm_1.log" 2>&1 &
wait
echo "== conformance and warm done at +$(( $(date +%s) - t0 ))s" | tee -a "$OUT/log.txt"
cat "$OUT"/warm_*.log | grep -v "^$" | tail -6 | tee -a "$OUT/log.txt"
python3 $T/conformance_shards.py "$OUT" merge triton --device cuda 2>&1 | tail -2 | cut -c1-1500 | tee -a "$OUT/log.txt"
B=$(( $(left) - 2 ))
[ "$B" -gt 30 ] && B=30
[ "$B" -lt 5 ] && B=5
timeout -k 2 "$B" python3 -m pagedcore.cli bench kernels --backend triton --case prefill \
  --case mixed --json "$OUT/kernels_triton_h200.json" > "$OUT/bench.log" 2>&1
tail -14 "$OUT/bench.log" | tee -a "$OUT/log.txt"
echo "== bench done at +$(( $(date +%s) - t0 ))s" | tee -a "$OUT/log.txt"
R=$(( $(left) - 1 ))
if [ "$R" -gt 6 ] && [ -n "${VARIANTS:-}" ]; then
  timeout -k 1 "$R" python3 $T/tma_variants.py "$OUT" --steps time --budget $((R - 2)) $VARIANTS > "$OUT/time.log" 2>&1
  grep '"ms"' "$OUT/time.log" | cut -c1-200 | tee -a "$OUT/log.txt"
fi
echo "== end at +$(( $(date +%s) - t0 ))s" | tee -a "$OUT/log.txt"
