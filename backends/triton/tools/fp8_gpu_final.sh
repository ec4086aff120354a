#!/usr/bin/env bash
# GPU job (one H200, ~45 s cap including compiles), the last round of issue 24's fp8 decode:
# 1. the decode sweep's round4 set (fp8_decode_sweep.py: kernels/decode_fp8.py with its own
#    prefetch against the shipped bf16 / fp8 defaults; correctness first);
# 2. `pagedcore bench kernels --backend triton --case decode --kv-cache-dtype fp8` with the
#    sweep's winner as PAGEDCORE_TRITON_DECODE_TILES when one beats the shipped default by
#    > 3 % (geometric mean of the three shapes; candidate.txt says which), else the default;
# 3. the same bench with the bf16 cache (`auto`), then (time permitting) fp8 with the shipped
#    default and bf16 with sinks.
# Runs from the tree's root (installed with pip -e), writes into OUT_DIR, ends before
# GPU_DEADLINE.
set -u
out=${OUT_DIR:?set OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
deadline=${GPU_DEADLINE:-$((t0 + 45))}
left() { echo $(( deadline - $(date +%s) )); }
el() { echo "== $1 at +$(( $(date +%s) - t0 ))s (left $(left)s)"; }
sweep=backends/triton/tools/fp8_decode_sweep.py
echo "commit ${PAGEDCORE_GIT_COMMIT:-?} start $(date -u +%T) left $(left)s"
sweep_s=$(( $(left) - 25 )); [ $sweep_s -gt 17 ] && sweep_s=17; [ $sweep_s -lt 8 ] && sweep_s=8
timeout -k 1 $sweep_s python3 $sweep "$out/sweep_round4.jsonl" $(( sweep_s - 5 )) round4 \
    > "$out/sweep_round4.txt" 2>&1
el "sweep rc=$?"; grep -E "^[0-9]+x|BAD" "$out/sweep_round4.txt" | cut -c1-200
cand=$(python3 $sweep --best "$out/sweep_round4.jsonl" 2>/dev/null)
echo "candidate: '${cand}'" | tee "$out/candidate.txt"
bench() {  # NAME ARGS...: one bench kernels run, if there is time for it
    local name=$1; shift
    [ "$(left)" -lt 8 ] && { el "no time left for $name"; return; }
    timeout -k 1 $(( $(left) - 1 )) python3 -m pagedcore.cli bench kernels --backend triton \
        --case decode "$@" --json "$out/kernels_$name.json" > "$out/kernels_$name.txt" 2>&1
    el "bench $name rc=$?"; grep -E "triton" "$out/kernels_$name.txt" | cut -c1-140 | head -6
}
if [ -n "$cand" ]; then
    PAGEDCORE_TRITON_DECODE_TILES="$cand" bench fp8_candidate --kv-cache-dtype fp8
    bench auto --kv-cache-dtype auto
    bench fp8 --kv-cache-dtype fp8
else
    bench fp8 --kv-cache-dtype fp8
    bench auto --kv-cache-dtype auto
fi
bench sinks --kv-cache-dtype auto --sinks
el done
