#!/usr/bin/env bash
# Issue #22 on one H200 (~100 s), most important first, each part under its own time limit:
# 1. the overlap identity diagnosis (overlap_diff.py: bf16 and fp32 with preemption; main's
#    fused kernels only, PAGEDCORE_FUSED_KERNELS=rms_norm,silu_mul);
# 2. fused attention / residual add vs the modules they replace (fused_check.py);
# 3. `pagedcore bench step` (CUDA graphs, overlap on and off, profiled; Chrome traces of the
#    overlapped rows), Llama-3-8B shape at 64 and 256, then Qwen2-0.5B at 256.
# Results under $OUT.
#
#   OUT=/tmp/step bash docs/benchmarks/run_step_h200.sh      # on the GPU machine, repo root
set -uo pipefail
OUT=${OUT:-/tmp/step_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
start=$(date +%s)
"$PY" -m pip install -q --no-deps --no-build-isolation -e . -e backends/triton > "$OUT/pip.txt" 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1 || true
echo "commit ${GIT_COMMIT:-unknown}" > "$OUT/commit.txt"
elapsed() { echo "[$(( $(date +%s) - start )) s] $*"; }
elapsed "installed"
PAGEDCORE_FUSED_KERNELS=rms_norm,silu_mul timeout "${DIFF_S:-28}" "$PY" \
    docs/benchmarks/overlap_diff.py "$OUT/overlap_diff.json" \
    --cases "${DIFF_CASES:-bf16-preempt,fp32-preempt,bf16-roomy}" > "$OUT/overlap_diff.txt" 2>&1
elapsed "overlap_diff rc=$?"; grep -v '^ ' "$OUT/overlap_diff.txt" | cut -c1-700 | tail -n 8
timeout "${FUSED_S:-16}" "$PY" docs/benchmarks/fused_check.py "$OUT/fused_check.json" \
    > "$OUT/fused_check.txt" 2>&1
elapsed "fused_check rc=$?"; cut -c1-900 "$OUT/fused_check.txt" | tail -n 4
bench() {  # NAME SECONDS SHAPE BATCHES STEPS [ENV...]
    local name=$1 secs=$2 shape=$3 batches=$4 steps=$5; shift 5
    env "$@" timeout "$secs" "$PY" -m pagedcore.cli bench step --model-shape "$shape" \
        --batch-sizes "$batches" --steps "$steps" --no-eager --profile \
        --trace-dir "$OUT/traces_$name" --json "$OUT/step_$name.json" \
        > "$OUT/step_$name.txt" 2>&1
    elapsed "bench step $name rc=$?"; grep -E "overlap (True|False)" "$OUT/step_$name.txt" | tail -n 8
}
bench llama "${LLAMA_S:-30}" llama3-8b "${LLAMA_BATCHES:-64,256}" 8
bench qwen "${QWEN_S:-16}" qwen2-0.5b 256 12
bench qwen_main_fused "${QWEN_S:-16}" qwen2-0.5b 256 12 PAGEDCORE_FUSED_KERNELS=rms_norm,silu_mul
