#!/usr/bin/env bash
# Issue #22 on one H200 (~95 s): the overlap identity diagnosis (overlap_diff.py: bf16 and
# fp32 with preemption, bf16 without), then `pagedcore bench step` (CUDA graphs, overlap on and
# off, profiled) for the Llama-3-8B shape at batch 1/64/256 and the Qwen2-0.5B shape at 256.
# Results under $OUT. Each part has its own time limit, so one slow part cannot eat the rest.
#
#   OUT=/tmp/step bash docs/benchmarks/run_step_h200.sh      # on the GPU machine, repo root
set -uo pipefail
OUT=${OUT:-/tmp/step_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
start=$(date +%s)
"$PY" -m pip install -q --no-deps --no-build-isolation -e . -e backends/triton > "$OUT/pip.txt" 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1 || true
git_commit=${GIT_COMMIT:-unknown}
echo "commit $git_commit" > "$OUT/commit.txt"
elapsed() { echo "[$(( $(date +%s) - start )) s] $*"; }
elapsed "installed"
timeout "${DIFF_S:-34}" "$PY" docs/benchmarks/overlap_diff.py "$OUT/overlap_diff.json" \
    --cases "${DIFF_CASES:-bf16-preempt,bf16-roomy,fp32-preempt}" > "$OUT/overlap_diff.txt" 2>&1
elapsed "overlap_diff rc=$?"; grep -v '^ ' "$OUT/overlap_diff.txt" | cut -c1-600 | tail -n 8
timeout "${LLAMA_S:-36}" "$PY" -m pagedcore.cli bench step --model-shape llama3-8b \
    --batch-sizes "${LLAMA_BATCHES:-1,64,256}" --steps 10 --no-eager --profile \
    --json "$OUT/step_llama.json" > "$OUT/step_llama.txt" 2>&1
elapsed "bench step llama rc=$?"; grep -E "batch|graphs|eager" "$OUT/step_llama.txt" | tail -n 12
timeout "${QWEN_S:-16}" "$PY" -m pagedcore.cli bench step --model-shape qwen2-0.5b \
    --batch-sizes "${QWEN_BATCHES:-256}" --steps 15 --no-eager --profile \
    --json "$OUT/step_qwen.json" > "$OUT/step_qwen.txt" 2>&1
elapsed "bench step qwen rc=$?"; grep -E "batch|graphs|eager" "$OUT/step_qwen.txt" | tail -n 6
