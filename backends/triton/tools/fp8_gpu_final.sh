#!/usr/bin/env bash
# GPU job (one H200, ~40 s cap including compiles): the shipped decode defaults through
# `pagedcore bench kernels --case decode` with an fp8 (e4m3) cache, a bf16 cache, and the bf16
# cache with attention sinks (the sinks' cost), in that order; the decode launches compiled
# ahead in parallel (fp8_decode_sweep.py --precompile) while the fp8 decode/long conformance
# cases start beside them (paused while anything is timed, resumed after). Runs from the tree's
# root (installed with pip -e), writes into OUT_DIR, stops before GPU_DEADLINE.
set -u
out=${OUT_DIR:?set OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
deadline=${GPU_DEADLINE:-$((t0 + 40))}
left() { echo $(( deadline - $(date +%s) )); }
el() { echo "== $1 at +$(( $(date +%s) - t0 ))s (left $(left)s)"; }
echo "commit ${PAGEDCORE_GIT_COMMIT:-?} start $(date -u +%T)"
timeout -k 1 $(( $(left) - 20 )) python3 backends/triton/tools/fp8_decode_sweep.py --precompile \
    > "$out/precompile.txt" 2>&1 &
pre=$!
confs=()
i=0
for k in decode/float16/hs128/bs16/h8kv2/fp8 decode/bfloat16/hs128/bs16/h8kv2/fp8 \
         long/float16/hs128/bs16/h8kv2/fp8 long/float16/hs128/bs16/h8kv2/sinks/fp8; do
    python3 -m pagedcore.cli conformance triton --device cuda -k "$k" --progress \
        --json "$out/conformance_fp8_$i.json" > "$out/conformance_fp8_$i.txt" 2>&1 &
    confs+=($!); i=$((i + 1))
done
wait $pre; el "precompile rc=$?"; tail -2 "$out/precompile.txt"
kill -STOP "${confs[@]}" 2>/dev/null  # nothing else on the GPU while timing
for run in fp8 auto sinks; do
    [ "$(left)" -lt 9 ] && { el "no time left for $run"; break; }
    args="--kv-cache-dtype $run"
    [ $run = sinks ] && args="--kv-cache-dtype auto --sinks"
    timeout -k 1 $(( $(left) - 2 )) python3 -m pagedcore.cli bench kernels --backend triton \
        --case decode $args --json "$out/kernels_$run.json" > "$out/kernels_$run.txt" 2>&1
    el "bench $run rc=$?"; grep -E "triton" "$out/kernels_$run.txt" | cut -c1-150 | head -6
done
kill -CONT "${confs[@]}" 2>/dev/null
while [ "$(left)" -gt 1 ]; do
    alive=0; for p in "${confs[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break; sleep 0.5
done
for p in "${confs[@]}"; do kill "$p" 2>/dev/null; done
el "conformance"; grep -hE "PASS|FAIL|passed|failed" "$out"/conformance_fp8_*.txt | tail -12
