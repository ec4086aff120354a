#!/usr/bin/env bash
# Issue #22, final H200 figures (~75 s), each part under its own time limit: `pagedcore bench
# step` on the Llama-3-8B shape (graphs, batch 1/64/256, overlap on and off, profiled) and the
# Qwen2-0.5B shape (graphs and eager, batch 1/64/256), then the overlap identity check and its
# per-request diff. Results under $OUT.
#
#   OUT=/tmp/step bash docs/benchmarks/run_step_h200_final.sh   # on the GPU machine, repo root
set -uo pipefail
OUT=${OUT:-/tmp/step_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
start=$(date +%s)
"$PY" -m pip install -q --no-deps --no-build-isolation -e . -e backends/triton > "$OUT/pip.txt" 2>&1
echo "commit ${GIT_COMMIT:-unknown}" > "$OUT/commit.txt"
elapsed() { echo "[$(( $(date +%s) - start )) s] $*"; }
elapsed "installed"
bench() {  # NAME SECONDS SHAPE BATCHES STEPS [FLAGS...]
    local name=$1 secs=$2 shape=$3 batches=$4 steps=$5; shift 5
    timeout "$secs" "$PY" -m pagedcore.cli bench step --model-shape "$shape" \
        --batch-sizes "$batches" --steps "$steps" --profile "$@" \
        --json "$OUT/step_$name.json" > "$OUT/step_$name.txt" 2>&1
    elapsed "bench step $name rc=$?"; grep -E "overlap (True|False)" "$OUT/step_$name.txt" | tail -n 12
}
bench llama "${LLAMA_S:-34}" llama3-8b 1,64,256 10 --no-eager
bench qwen "${QWEN_S:-22}" qwen2-0.5b 1,64,256 12
timeout "${CHECK_S:-16}" "$PY" docs/benchmarks/overlap_diff.py "$OUT/overlap_diff.json" \
    --cases bf16-preempt,fp32-preempt > "$OUT/overlap_diff.txt" 2>&1
elapsed "overlap_diff rc=$?"; grep -v '^ ' "$OUT/overlap_diff.txt" | cut -c1-600 | tail -n 4
