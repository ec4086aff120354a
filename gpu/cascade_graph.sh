#!/usr/bin/env bash
# H200: the CUDA-graph cascade decode plan on one attention layer (Qwen2-0.5B shape, 64 x
# (4096 shared + 64 own)): replay vs eager cascade vs plain (correctness at 4 prefix lengths
# below the captured capacity) and replay times. Then the lead's shared-decode engine bench
# for context (cascade off/always/auto; the engine does not yet use the graph plan).
# Results under $OUT. ~60-120 s.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
cd "$(dirname "$0")/.."
timeout 90 python3 gpu/cascade_graph.py >"$OUT/cascade_graph.txt" 2>&1; echo "rc=$?" >>"$OUT/cascade_graph.txt"
tail -30 "$OUT/cascade_graph.txt"
