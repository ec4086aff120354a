#!/usr/bin/env bash
# Issue #22, the final round on one H200 (branch `step`): `pagedcore bench step` for the
# Qwen2-0.5B shape at batch 256 (CUDA graphs and eager, overlap on and off, every output or the
# finished ones built per step; the warm 4K prefix hit's first token; 64 requests decoding over
# that shared prefix with cascade off / always / auto), then the Llama-3-8B shape at batch 1
# and 64 (graphs). No profiling (round 2, docs/benchmarks/step_h200_r2/, has the kernels).
# Each part under `timeout`, budgeted from GPU_DEADLINE (epoch s); every bench writes its JSON
# incrementally, so a cut part keeps the rows it finished. Results in $OUT_DIR.
#
#   OUT_DIR=/tmp/out GPU_DEADLINE=$(( $(date +%s) + 60 )) bash docs/benchmarks/run_step_final_gpu.sh
# CPU dry run: QWEN_SHAPE=tiny LLAMA_SHAPE=tiny QWEN_BATCHES=2 LLAMA_BATCHES=1,2 PREFIX=64 \
#   EXTRA="--device cpu --context 16" bash docs/benchmarks/run_step_final_gpu.sh
set -uo pipefail
OUT=${OUT_DIR:-/tmp/step_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
DEADLINE=${GPU_DEADLINE:-$(( $(date +%s) + 60 ))}
start=$(date +%s)
echo "commit ${PAGEDCORE_GIT_COMMIT:-unknown}" > "$OUT/commit.txt"
log() { echo "[$(( $(date +%s) - start )) s] $*" | tee -a "$OUT/log.txt"; }
left() { echo $(( DEADLINE - $(date +%s) - ${1:-2} )); }
bench() {  # NAME CAP_S ARGS...: one bench under min(CAP_S, what is left)
    local name=$1 cap=$2; shift 2
    local t; t=$(left 2); (( t > cap )) && t=$cap
    if (( t < 8 )); then log "skip $name (${t} s left)"; return; fi
    timeout "$t" "$PY" -m pagedcore.cli bench step "$@" ${EXTRA:-} \
        --json "$OUT/step_$name.json" > "$OUT/step_$name.txt" 2>&1
    log "bench step $name rc=$? (limit ${t} s)"
    grep -E "overlap (True|False)|prefix hit|shared-prefix" "$OUT/step_$name.txt" | tee -a "$OUT/log.txt"
}
log "start; deadline in $(left 0) s"
bench qwen "${QWEN_S:-34}" --model-shape "${QWEN_SHAPE:-qwen2-0.5b}" \
    --batch-sizes "${QWEN_BATCHES:-256}" --steps 8 --outputs all,finished \
    --prefix-hit "${PREFIX:-4096}" --prefix-reps 5 --shared-decode
bench llama "${LLAMA_S:-60}" --model-shape "${LLAMA_SHAPE:-llama3-8b}" \
    --batch-sizes "${LLAMA_BATCHES:-1,64}" --steps 8 --no-eager --max-num-batched-tokens 1024
log "done"
