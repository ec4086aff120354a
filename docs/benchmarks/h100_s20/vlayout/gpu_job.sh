#!/usr/bin/env bash
# Ran at 83e6a68 (backends/triton/tools/fp8_vlayout_gpu.sh there); the transposed V layout it
# measures was removed afterwards (slower: ../README.md), so at later commits it no longer runs.
# GPU job (one H100/H200, ~7 min): the fp8 cache with V transposed within each block
# (pagedcore_triton/kv_layout.py), correctness first, then timed against the token-major
# layout and the bf16 cache:
#  1. the fp8 conformance cases of the triton backend (real NaN-poisoned slots; the
#     interpreter reads fp8 NaN bytes as finite numbers) and the fp8 layout / sinks tests,
#     beside the parallel compile of the sweep's round5 variants;
#  2. the decode sweep's round5 set (fp8_decode_sweep.py: each variant checked against a
#     float32 reference first, then timed), conformance paused meanwhile;
#  3. `pagedcore bench kernels --backend triton --case decode` with the fp8 cache (shipped
#     default: V transposed), the token-major layout (PAGEDCORE_TRITON_FP8_V_LAYOUT=token),
#     and the bf16 cache; then the prefill case with the fp8 cache in both layouts;
#  4. the engine over the fp8 cache with CUDA graphs against the 16-bit cache and the
#     reference backend's fp8 engine (fp8_engine_check.py), beside the rest of step 1.
# Usage (from the tree's root): OUT=DIR bash backends/triton/tools/fp8_vlayout_gpu.sh
set -u
out=${OUT:?set OUT}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
deadline=${GPU_DEADLINE:-$((t0 + 540))}
left() { echo $(( deadline - $(date +%s) )); }
el() { echo "== $1 at +$(( $(date +%s) - t0 ))s (left $(left)s)"; }
sweep=backends/triton/tools/fp8_decode_sweep.py
echo "commit ${PAGEDCORE_GIT_COMMIT:-?} $(nvidia-smi --query-gpu=name --format=csv,noheader)"
python3 -c "import importlib.metadata as m; m.distribution('pagedcore-triton')" 2>/dev/null \
  || python3 -m pip install -q --no-deps --no-build-isolation -e . -e backends/triton \
       > "$out/pip.txt" 2>&1
python3 -c "import pagedcore_triton, triton; print('using', pagedcore_triton.__file__, triton.__version__)"
el "install checked"
python3 $sweep --precompile round5 > "$out/precompile.txt" 2>&1 &
pre=$!
confs=()
i=0
for k in /fp8_e4m3 /fp8_e5m2 graph/; do
    timeout -k 2 300 python3 -m pagedcore.cli conformance triton --device cuda -k "$k" \
        --progress --json "$out/conformance_$i.json" > "$out/conformance_$i.txt" 2>&1 &
    confs+=($!); i=$((i + 1))
done
timeout -k 2 300 python3 -m pytest -q -rf backends/triton/tests/test_fp8_v_layout.py \
    backends/triton/tests/test_triton_fp8_sinks.py > "$out/pytest_fp8.txt" 2>&1
el "pytest rc=$?"; tail -3 "$out/pytest_fp8.txt"
wait $pre; el "precompile rc=$?"; tail -2 "$out/precompile.txt"
kill -STOP "${confs[@]}" 2>/dev/null  # nothing else on the GPU while timing
sweep_s=$(( $(left) - 260 )); [ $sweep_s -gt 170 ] && sweep_s=170
SWEEP_POOL=0 timeout -k 2 "$sweep_s" python3 $sweep "$out/sweep_round5.jsonl" \
    $(( sweep_s - 10 )) round5 > "$out/sweep_round5.txt" 2>&1
el "sweep rc=$?"; grep -E "^[0-9]+x|BAD|budget" "$out/sweep_round5.txt" | cut -c1-220
bench() {  # NAME ARGS...: one bench kernels run, if there is time
    local name=$1; shift
    [ "$(left)" -lt 40 ] && { el "no time left for $name"; return; }
    timeout -k 1 45 python3 -m pagedcore.cli bench kernels --backend triton \
        "$@" --json "$out/kernels_$name.json" > "$out/kernels_$name.txt" 2>&1
    el "bench $name rc=$?"; grep -E "triton" "$out/kernels_$name.txt" | cut -c1-150 | head -8
}
bench fp8 --case decode --kv-cache-dtype fp8
PAGEDCORE_TRITON_FP8_V_LAYOUT=token bench fp8_token --case decode --kv-cache-dtype fp8
bench auto --case decode --kv-cache-dtype auto
bench fp8_prefill --case prefill --kv-cache-dtype fp8
PAGEDCORE_TRITON_FP8_V_LAYOUT=token bench fp8_prefill_token --case prefill --kv-cache-dtype fp8
kill -CONT "${confs[@]}" 2>/dev/null
timeout -k 2 $(( $(left) - 10 )) python3 backends/triton/tools/fp8_engine_check.py \
    "$out/engine_fp8.json" > "$out/engine_fp8.txt" 2>&1
el "engine check rc=$?"; cut -c1-400 "$out/engine_fp8.txt" | tail -4
while [ "$(left)" -gt 5 ]; do
    alive=0; for p in "${confs[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break; sleep 1
done
for p in "${confs[@]}"; do kill "$p" 2>/dev/null; done
el "conformance"; grep -hE "passed|failed|FAIL" "$out"/conformance_*.txt | tail -12
