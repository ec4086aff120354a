#!/usr/bin/env bash
# One device call: build, correctness sweep, benchmarks, conformance suite, sanitizers.
# Usage (repo root, on the GPU machine): bash backends/cuda_paged/bench/gpu_run.sh [COMMIT] [STAGES]
set -o pipefail
COMMIT=${1:-unknown}
STAGES=${2:-build,check,bench,conformance,sanitize}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONUNBUFFERED=1
B=backends/cuda_paged/bench
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
if [[ $STAGES == *build* ]]; then
  start=$(date +%s)
  which python3 nvcc; python3 -c "import torch; print(torch.__version__, torch.version.cuda)"
  python3 -m pip install -v --no-build-isolation --no-deps -e . ./backends/cuda_paged \
    >"$OUT/build.log" 2>&1 || { tail -60 "$OUT/build.log"; exit 1; }
  # (PAGEDCORE_CUDA_PAGED_ARCHS=90 in the environment builds sm_90 only: faster)
  echo "build seconds: $(( $(date +%s) - start ))" | tee -a "$OUT/build.log"
  grep "pagedcore-cuda-paged:" "$OUT/build.log"
  python3 -c "import torch, pagedcore_cuda_paged._C as c; print('extension', c.__file__)" \
    || { grep -iE "error|warning: " "$OUT/build.log" | head -40; exit 1; }
fi
if [[ $STAGES == *check* ]]; then
  timeout 120 python3 $B/check_gpu.py --json "$OUT/check.json" 2>&1 | tee "$OUT/check.log" \
    | grep -v ^PASS
  timeout 30 python3 $B/check_gpu.py --graphs 2>&1 | tee "$OUT/graphs.log"
fi
[[ $STAGES == *bench* ]] && timeout 150 python3 $B/bench_kernels.py --commit "$COMMIT" \
  --json "$OUT/cuda_paged_h200.json" 2>&1 | tee "$OUT/bench.log"
if [[ $STAGES == *sanitize* ]]; then
  for tool in memcheck racecheck; do
    timeout 70 compute-sanitizer --tool $tool --error-exitcode 9 python3 $B/sanitize_case.py \
      >"$OUT/$tool.log" 2>&1; echo "$tool exit $?"; tail -4 "$OUT/$tool.log"
  done
fi
[[ $STAGES == *conformance* ]] && timeout ${CONF_TIMEOUT:-150} python3 -m pagedcore.cli conformance cuda_paged 2>&1 \
  | tee "$OUT/conformance.log" | tail -25
