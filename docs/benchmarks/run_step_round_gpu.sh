#!/usr/bin/env bash
# Issue #22 on one H200 (branch `step`): the Qwen2-0.5B step profiled at batch 256 (greedy and
# sampled at temperature 1; every output built per step, or the finished ones only),
# its eager rows, and the warm 4K prefix hit's first token (graphs
# and eager) and 64 requests decoding over that shared prefix with cascade off, always and auto;
# the sampler's batched draw against the per-row one; then the Llama-3-8B step
# at 256 profiled kernel by kernel. Each part under `timeout`, budgeted from GPU_DEADLINE
# (epoch s; the job is killed 15 s after it); every bench writes its JSON incrementally, so a
# cut part keeps the rows it finished. Results in $OUT_DIR.
#
#   OUT_DIR=/tmp/out GPU_DEADLINE=$(( $(date +%s) + 80 )) bash docs/benchmarks/run_step_round_gpu.sh
# CPU dry run: QWEN_SHAPE=tiny LLAMA_SHAPE=tiny QWEN_BATCHES=2 LLAMA_BATCHES=2 PREFIX=64 \
#   QWEN_EXTRA="--device cpu --context 16" LLAMA_EXTRA="--device cpu --context 16" \
#   AB_EXTRA="--rows 8 --vocab 500" bash ...
set -uo pipefail
OUT=${OUT_DIR:-/tmp/step_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
DEADLINE=${GPU_DEADLINE:-$(( $(date +%s) + 80 ))}
start=$(date +%s)
echo "commit ${PAGEDCORE_GIT_COMMIT:-unknown}" > "$OUT/commit.txt"
log() { echo "[$(( $(date +%s) - start )) s] $*" | tee -a "$OUT/log.txt"; }
left() { echo $(( DEADLINE - $(date +%s) - ${1:-2} )); }  # seconds to the deadline, minus a margin
# NAME CAP_S ARGS...: one bench under min(CAP_S, what is left).
bench() {
    local name=$1 cap=$2; shift 2
    local t; t=$(left 3); (( t > cap )) && t=$cap
    if (( t < 8 )); then log "skip $name (${t} s left)"; return; fi
    timeout "$t" "$PY" -m pagedcore.cli bench step "$@" --json "$OUT/step_$name.json" \
        > "$OUT/step_$name.txt" 2>&1
    log "bench step $name rc=$? (limit ${t} s)"
    grep -E "overlap (True|False)|prefix hit|shared-prefix" "$OUT/step_$name.txt" | tail -n 12 | tee -a "$OUT/log.txt"
}
log "start; deadline in $(left 0) s"
# The sampler's unseeded rows: one draw for all vs the per-row loop it replaced (~5 s).
t=$(left 3); (( t > 15 )) && t=15
if (( t >= 6 )); then
    timeout "$t" "$PY" docs/benchmarks/sampler_ab.py "$OUT/sampler_ab.json" ${AB_EXTRA:-} \
        > "$OUT/sampler_ab.txt" 2>&1
    log "sampler_ab rc=$?"; tail -n 5 "$OUT/sampler_ab.txt" | tee -a "$OUT/log.txt"
fi
bench qwen "${QWEN_S:-48}" --model-shape "${QWEN_SHAPE:-qwen2-0.5b}" --batch-sizes "${QWEN_BATCHES:-256}" \
    --steps 8 --profile --prefix-hit "${PREFIX:-4096}" --prefix-reps 5 --temperatures 0,1 \
    --outputs all,finished --shared-decode \
    ${QWEN_EXTRA:-}
bench llama "${LLAMA_S:-60}" --model-shape "${LLAMA_SHAPE:-llama3-8b}" --batch-sizes "${LLAMA_BATCHES:-256}" \
    --steps 6 --profile --no-eager ${LLAMA_EXTRA:-}
log "done"
