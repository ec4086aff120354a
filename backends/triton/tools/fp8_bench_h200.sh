#!/usr/bin/env bash
# fp8 vs bf16 decode of the Triton backend's shipped defaults on one H200 in ~42 s
# (docs/benchmarks/fp8_h200.json): the decode kernels compiled ahead in parallel, then
# `pagedcore bench kernels --case decode` with an fp8 (e4m3) and a bf16 cache, the second
# round of the decode sweep (fp8_decode_sweep.py round2), and the quick conformance run's fp8
# cases in four processes (started beside the compiles, paused while anything is timed).
# Usage (from the tree's root, the tree on PYTHONPATH): fp8_bench_h200.sh OUTDIR
set -u
out=${1:?usage: fp8_bench_h200.sh OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
el() { echo "== $1 at +$(( $(date +%s) - t0 ))s"; }
python3 backends/triton/tools/fp8_decode_sweep.py --precompile round2 > "$out/precompile.txt" 2>&1 &
pre=$!
# entry points for `pagedcore ... triton`: any installed pagedcore-triton will do (this tree
# is first on PYTHONPATH), else install this one
python3 -c "import importlib.metadata as m; m.distribution('pagedcore-triton')" 2>/dev/null \
  || python3 -m pip install -q --no-deps --no-build-isolation -e . -e backends/triton \
       > "$out/pip.txt" 2>&1
python3 -c "import pagedcore_triton, pagedcore; print('using', pagedcore_triton.__file__, pagedcore.__file__)"
el "install checked"
confs=()
i=0
for k in decode/float16/hs128/bs16/h8kv2/fp8 mixed/bfloat16/hs128/bs16/h8kv2/fp8 \
         mixed/float16/hs128/bs16/h8kv2/fp8 prefill/float16/hs128/bs16/h8kv2/fp8; do
    python3 -m pagedcore.cli conformance triton --device cuda --quick -k "$k" --progress \
        --json "$out/conformance_fp8_$i.json" > "$out/conformance_fp8_$i.txt" 2>&1 &
    confs+=($!); i=$((i + 1))
done
wait $pre; el "precompile rc=$?"; tail -1 "$out/precompile.txt"
kill -STOP "${confs[@]}" 2>/dev/null  # nothing else on the GPU while timing
for kv in fp8 auto; do
    timeout -k 1 "${BENCH_S:-14}" python3 -m pagedcore.cli bench kernels --backend triton \
        --case decode --kv-cache-dtype $kv --json "$out/kernels_$kv.json" \
        > "$out/kernels_$kv.txt" 2>&1
    el "bench $kv rc=$?"; grep -E "triton" "$out/kernels_$kv.txt" | head -6
done
left=$(( ${TOTAL_S:-41} - 3 - ($(date +%s) - t0) ))
if [ "$left" -ge 5 ]; then
    sweep_s=$(( left < 9 ? left : 9 ))
    SWEEP_POOL=0 timeout -k 1 "$sweep_s" python3 backends/triton/tools/fp8_decode_sweep.py \
        "$out/sweep_round2.jsonl" $(( sweep_s - 1 )) round2 > "$out/sweep_round2.txt" 2>&1
    el "sweep rc=$?"; grep -E "^[0-9]+x" "$out/sweep_round2.txt"
fi
kill -CONT "${confs[@]}" 2>/dev/null
while [ $(( $(date +%s) - t0 )) -lt "${TOTAL_S:-41}" ]; do
    alive=0; for p in "${confs[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break; sleep 0.5
done
for p in "${confs[@]}"; do kill "$p" 2>/dev/null; done
el "conformance"; grep -hE "PASS|FAIL|passed|failed" "$out"/conformance_fp8_*.txt | tail -12
