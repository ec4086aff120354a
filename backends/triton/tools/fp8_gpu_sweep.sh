#!/usr/bin/env bash
# GPU job (one H200, ~60 s cap including compiles): the decode sweep's third set
# (fp8_decode_sweep.py round3: kernels/decode_fp8.py's modes against the shipped bf16 / fp8
# defaults, more split-KV segments at 8x32768, the sinks' cost), correctness first, kernels
# compiled by a pool in the order they are measured. Runs from the tree's root (installed
# with pip -e), writes into OUT_DIR, stops before GPU_DEADLINE.
set -u
out=${OUT_DIR:?set OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
deadline=${GPU_DEADLINE:-$((t0 + 60))}
left() { echo $(( deadline - $(date +%s) )); }
echo "commit ${PAGEDCORE_GIT_COMMIT:-?} start $(date -u +%T) left $(left)s"
nvidia-smi -L > "$out/gpu.txt" 2>&1
budget=$(( $(left) - 10 ))
timeout -k 2 $(( $(left) - 4 )) python3 backends/triton/tools/fp8_decode_sweep.py \
    "$out/sweep_round3.jsonl" "$budget" round3 > "$out/sweep_round3.txt" 2>&1
echo "sweep rc=$? at +$(( $(date +%s) - t0 ))s"
grep -v -i warn "$out/sweep_round3.txt" | tail -25
