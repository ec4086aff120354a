#!/usr/bin/env bash
# GPU round: the fp8 / bf16 decode sweep (fp8_decode_sweep.py). Run from the tree's root with
# OUT set; uses the tree on PYTHONPATH (no install), a fresh Triton cache, ~100 s at most.
set -u
: "${OUT:?set OUT}"
export PYTHONPATH="$PWD:$PWD/backends/triton${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR="$(mktemp -d /tmp/fp8_triton_cache.XXXX)"
python3 backends/triton/tools/fp8_decode_sweep.py "$OUT/sweep.jsonl" "${SWEEP_BUDGET:-78}" \
    2>&1 | tee "$OUT/sweep.txt" | grep -v Warning
rm -rf "$TRITON_CACHE_DIR"
