#!/usr/bin/env bash
# cuda_paged fp8 decode, keys as the mma's M rows (issue 24), session 25. Steps run in the order
# given, each with its own time limit; everything under $OUT also goes into $OUT/round.tgz (the
# device tool brings back only a few files per call). On a fresh device machine `install` and
# `build` come first. Repo root:
#   PAGEDCORE_GIT_COMMIT=<sha> OUT=... bash gpu/fp8_keysm_round.sh [steps...]
# Steps: install build tests ncu probe conf grid bench memcheck
# PAGEDCORE_CUDA_PAGED_FP8_DECODE=rows|keys picks the fp8 decode kernel (rows: the grouped mma
# kernel with heads as M; keys: keys as M); `probe`, `conf`, `grid` and `bench` run both.
set -uo pipefail
OUT=${OUT:-/tmp/fp8_keysm_round}
mkdir -p "$OUT"
steps=${*:-"install build tests ncu probe conf grid bench memcheck"}
KERNELS=${KERNELS:-"rows keys"}
export PYTHONUNBUFFERED=1 MAX_JOBS=16 PAGEDCORE_CUDA_PAGED_ARCHS=90
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader > "$OUT/device.txt" 2>&1 || true
run() {  # name, limit seconds, command...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? ${SECONDS}s total, $(( $(date +%s) - t0 ))s" | tee -a "$OUT/steps.txt"
  tail -n 6 "$OUT/$name.log"
}
NCU_SECTIONS="--section SpeedOfLight --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis"
for s in $steps; do
  case $s in
    install) run install 120 python3 -m pip install --no-deps --no-build-isolation -e . -e backends/triton ;;
    build) run build 300 python3 -m pip install -v --no-build-isolation --no-deps ./backends/cuda_paged ;;
    tests) run tests_engine 300 python3 -m pytest -q -x tests/engine/test_engine_gpu.py tests/engine/test_cuda_graph.py tests/engine/test_mixed_graphs.py backends/triton/tests/test_cudagraph.py backends/triton/tests/test_mixed_capture.py
           run tests_prefill_tma 200 python3 -m pytest -q backends/triton/tests/test_prefill_tma.py ;;
    ncu) for k in $KERNELS; do
           PAGEDCORE_CUDA_PAGED_FP8_DECODE=$k run ncu_$k 150 ncu --clock-control none --kernel-name regex:decode --launch-count 3 $NCU_SECTIONS \
             python3 backends/cuda_paged/bench/decode_probe.py --kv fp8,auto --iters 2
         done ;;
    probe) for shape in 64x4096 8x32768 256x1024; do for k in $KERNELS; do
             PAGEDCORE_CUDA_PAGED_FP8_DECODE=$k run probe_${k}_$shape 90 python3 backends/cuda_paged/bench/decode_probe.py --shape $shape --kv fp8,auto,fp8_e5m2 --json "$OUT/probe_${k}_$shape.json"
           done; done ;;
    conf) for k in $KERNELS; do
            PAGEDCORE_CUDA_PAGED_FP8_DECODE=$k run conf_$k 150 python3 -m pagedcore.cli conformance cuda_paged --device cuda --json "$OUT/conformance_$k.json"
          done ;;
    grid) for k in $KERNELS; do
            PAGEDCORE_CUDA_PAGED_FP8_DECODE=$k run grid_$k 120 python3 gpu/fp8_grid.py "$OUT/fp8_grid_$k.json"
          done ;;
    bench) for k in $KERNELS; do for kv in auto fp8; do
             PAGEDCORE_CUDA_PAGED_FP8_DECODE=$k run bench_${k}_$kv 60 python3 -m pagedcore.cli bench kernels --backend cuda_paged --case decode --kv-cache-dtype $kv --json "$OUT/bench_decode_${k}_$kv.json"
           done; done ;;
    memcheck) PAGEDCORE_CUDA_PAGED_FP8_DECODE=keys run memcheck 120 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pagedcore.cli \
                conformance cuda_paged --device cuda -k fp8 ;;
    *) echo "unknown step $s" ;;
  esac
done
tar czf /tmp/fp8_keysm_round.tgz -C "$OUT" . && mv /tmp/fp8_keysm_round.tgz "$OUT/round.tgz"
exit 0
