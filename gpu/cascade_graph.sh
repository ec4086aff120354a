#!/usr/bin/env bash
# H200 (~120 s): (1) the CUDA-graph cascade decode plan on one attention layer at the
# Qwen2-0.5B shape (60 requests in a 64 bucket, 4096 shared + 64 own, bf16): captured once,
# replayed at 4 prefix lengths up to the capacity, against the eager cascade and the plain
# plan (rel. error < 2e-2, no NaN), and replay timings: graph cascade vs plain graph vs eager
# cascade (one layer). (2) For context, the engine's shared-prefix decode (cascade
# off/always/auto), which does not use the graph plan yet (the baseline to beat).
# Results under $OUT: cascade_graph.{json,txt}, step_shared.{json,txt}.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
cd "$(dirname "$0")/.."
timeout 50 python3 gpu/cascade_graph.py >"$OUT/cascade_graph.txt" 2>&1
echo "rc=$?" >>"$OUT/cascade_graph.txt"
tail -40 "$OUT/cascade_graph.txt"
timeout 60 python3 -m pagedcore.cli bench step --model-shape qwen2-0.5b --batch-sizes 64 \
    --steps 8 --prefix-hit 4096 --prefix-reps 2 --shared-decode \
    --json "$OUT/step_shared.json" >"$OUT/step_shared.txt" 2>&1
echo "rc=$?" >>"$OUT/step_shared.txt"
grep -E "shared-prefix|rc=" "$OUT/step_shared.txt"
