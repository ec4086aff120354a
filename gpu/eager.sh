#!/usr/bin/env bash
# Issue 22 on one H200 (branch eager14): the Qwen2-0.5B decode step at batch 256 (~560
# context) with CUDA graphs and eagerly (`pagedcore bench step`, overlap on and off), then
# where the eager step's host time goes (gpu/eager_host_profile.py: torch.profiler CPU ops per
# step, host phases, host syncs). Results in $OUT; ~100 s. Run from the worktree root:
#   OUT=/tmp/out bash gpu/eager.sh
set -uo pipefail
OUT=${OUT:-/tmp/eager_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null || true
nvidia-smi -L > "$OUT/gpu.txt" 2>&1 || true
timeout 70 "$PY" -m pagedcore.cli bench step --model-shape qwen2-0.5b --batch-sizes 256 \
    --steps 8 --json "$OUT/step_eager.json" > "$OUT/step_eager.txt" 2>&1
echo "bench step rc=$?" | tee -a "$OUT/log.txt"
grep -E "overlap|eager|graphs" "$OUT/step_eager.txt" | tail -12
timeout 45 "$PY" gpu/eager_host_profile.py --out "$OUT" --batch 256 --steps 4 \
    > "$OUT/eager_host.txt" 2>&1
echo "eager_host_profile rc=$?" | tee -a "$OUT/log.txt"
head -40 "$OUT/eager_host.txt"
