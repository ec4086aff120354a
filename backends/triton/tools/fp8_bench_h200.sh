#!/usr/bin/env bash
# fp8 vs bf16 decode of the Triton backend's shipped defaults on one H200, in ~50 s
# (docs/benchmarks/fp8_h200.json): the decode kernels compiled ahead in parallel, then
# `pagedcore bench kernels --case decode` with an fp8 (e4m3) and a bf16 cache, and the quick
# conformance run's fp8 cases (started beside the compiles, paused during the timings).
# Usage (from the tree's root): fp8_bench_h200.sh OUTDIR
set -u
out=${1:?usage: fp8_bench_h200.sh OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
el() { echo "== $1 at +$(( $(date +%s) - t0 ))s"; }
python3 backends/triton/tools/fp8_decode_sweep.py --precompile > "$out/precompile.txt" 2>&1 &
pre=$!
timeout -k 2 "${CONF_S:-46}" python3 -m pagedcore.cli conformance triton --device cuda --quick \
    -k fp8 --progress --json "$out/conformance_fp8_quick.json" \
    > "$out/conformance_fp8_quick.txt" 2>&1 &
conf=$!
wait $pre; el "precompile rc=$?"
kill -STOP $conf 2>/dev/null  # no other GPU work while the benches time
for kv in fp8 auto; do
    timeout -k 2 "${BENCH_S:-15}" python3 -m pagedcore.cli bench kernels --backend triton \
        --case decode --kv-cache-dtype $kv --json "$out/kernels_$kv.json" \
        > "$out/kernels_$kv.txt" 2>&1
    el "bench $kv rc=$?"; grep -E "^ *(decode|│).*triton" "$out/kernels_$kv.txt" | head -8
done
kill -CONT $conf 2>/dev/null
wait $conf; el "conformance rc=$?"; tail -4 "$out/conformance_fp8_quick.txt"
