#!/usr/bin/env bash
# Session 21, issue 26: where the cascade step's time goes (GPU). Writes under $OUT.
#   OUT=... PAGEDCORE_GIT_COMMIT=<sha> bash docs/benchmarks/h200_s21/cascade_probe.sh
set -u
export PYTHONPATH="$PWD:$PWD/backends/triton${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > "$OUT/device.txt" 2>&1
timeout 300 python3 backends/triton/tools/cascade_probe.py --json "$OUT/probe.json" \
    > "$OUT/probe.log" 2>&1; echo "probe rc $?" >> "$OUT/probe.log"
timeout 120 ncu --clock-control none --kernel-name regex:"cascade_prefix|paged_attention" \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section MemoryWorkloadAnalysis \
    python3 backends/triton/tools/cascade_probe.py --json "$OUT/ncu_probe.json" --ncu \
    > "$OUT/ncu.txt" 2>&1; echo "ncu rc $?" >> "$OUT/ncu.txt"
tail -5 "$OUT/probe.log"; grep -E "cascade_prefix|paged_attention|Duration|Registers|Achieved Occ|DRAM Through" "$OUT/ncu.txt" | head -60
