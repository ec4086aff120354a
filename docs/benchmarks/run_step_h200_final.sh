#!/usr/bin/env bash
# Issue #22 on one H200, each part under its own time limit (a fresh machine spends ~10-20 s
# per model on Triton compilation and graph capture before the first figure):
# 1. the fused kernels against the modules they replace (fused_check.py --quick: bits, rel. error);
# 2. `pagedcore bench step` (CUDA graphs, overlap on and off) for the Qwen2-0.5B shape at 256
#    and the Llama-3-8B shape at 256;
# 3. the overlap identity diagnosis in fp32 with preemption (overlap_diff.py).
# Results under $OUT. The issue-#22 session ran it with the limits 13 / 14 / rest of 57 s: only the 8B
# rows finished (docs/benchmarks/step_h200.json); the defaults below are what the parts need.
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
timeout "${FUSED_S:-45}" "$PY" docs/benchmarks/fused_check.py "$OUT/fused_check.json" --quick \
    > "$OUT/fused_check.txt" 2>&1
elapsed "fused_check rc=$?"; cut -c1-1200 "$OUT/fused_check.txt" | tail -n 3
bench() {  # NAME SECONDS SHAPE BATCHES STEPS (every fused kind: unset, only the GPU-checked ones run)
    PAGEDCORE_FUSED_KERNELS=${PAGEDCORE_FUSED_KERNELS:-1} timeout "$2" "$PY" -m pagedcore.cli bench step --model-shape "$3" --batch-sizes "$4" \
        --steps "$5" --no-eager --json "$OUT/step_$1.json" > "$OUT/step_$1.txt" 2>&1
    elapsed "bench step $1 rc=$?"; grep -E "overlap (True|False)" "$OUT/step_$1.txt" | tail -n 8
}
bench qwen "${QWEN_S:-45}" qwen2-0.5b "${QWEN_BATCHES:-256}" 12
bench llama "${LLAMA_S:-60}" llama3-8b "${LLAMA_BATCHES:-256}" 8
timeout "${DIFF_S:-45}" "$PY" docs/benchmarks/overlap_diff.py "$OUT/overlap_diff.json" \
    --cases fp32-preempt > "$OUT/overlap_diff.txt" 2>&1
elapsed "overlap_diff rc=$?"; grep -v '^ ' "$OUT/overlap_diff.txt" | cut -c1-600 | tail -n 3
