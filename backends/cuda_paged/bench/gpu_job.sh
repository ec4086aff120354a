#!/usr/bin/env bash
# cuda_paged GPU job (issue 6): build (sm_90 only), correctness of every kernel variant against
# the torch reference (NaN-poisoned cache), timings of every variant with copy bandwidth and
# SDPA in the same run, conformance, memcheck. Most important first; each step has its own
# timeout. Usage (repo root): bash backends/cuda_paged/bench/gpu_job.sh RESULT_DIR
set -o pipefail
R=${1:?usage: gpu_job.sh RESULT_DIR}
mkdir -p "$R"
export PYTHONUNBUFFERED=1 MAX_JOBS=16 PAGEDCORE_CUDA_PAGED_ARCHS=90
B=backends/cuda_paged/bench
T0=$(date +%s)
el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }

el "build"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
timeout 120 python3 -m pip install -v --no-build-isolation --no-deps ./backends/cuda_paged \
  > "$R/build.log" 2>&1
rc=$?
el "build rc=$rc"
grep -E "pagedcore-cuda-paged:|error" "$R/build.log" | head -20
python3 -c "import torch, pagedcore_cuda_paged._C as c; print('extension', c.__file__)" || {
  grep -iE "error|warning: " "$R/build.log" | head -40; tail -30 "$R/build.log"; exit 1; }

el "check mma (new kernels)"
timeout 90 python3 $B/check_gpu.py --only mma --json "$R/check_mma.json" 2>&1 \
  | tee "$R/check_mma.log" | grep -v ^PASS

el "cuda graphs (capture + replay after in-place rewrites)"
timeout 20 python3 $B/check_gpu.py --graphs 2>&1 | tee "$R/graphs.log"

el "bench decode + prefill + mixed"
timeout 60 python3 $B/bench_kernels.py --sections decode,prefill,mixed \
  --json "$R/bench.json" 2>&1 | tee "$R/bench.log" | grep -v "^  *$"

el "conformance (full)"
timeout 40 python3 -m pagedcore.cli conformance cuda_paged --json "$R/conformance.json" \
  > "$R/conformance.log" 2>&1
echo "conformance rc=$?"; tail -6 "$R/conformance.log"

el "check classic kernels"
timeout 25 python3 $B/check_gpu.py --only classic --json "$R/check_classic.json" 2>&1 \
  | tee "$R/check_classic.log" | grep -v ^PASS

el "crossover (mma)"
timeout 30 python3 $B/bench_kernels.py --sections crossover --json "$R/crossover.json" 2>&1 \
  | tail -30

el "memcheck"
timeout 30 compute-sanitizer --tool memcheck --error-exitcode 9 python3 $B/sanitize_case.py \
  > "$R/memcheck.log" 2>&1
echo "memcheck exit $?"; tail -4 "$R/memcheck.log"
el "racecheck"
timeout 45 compute-sanitizer --tool racecheck --error-exitcode 9 python3 $B/sanitize_case.py \
  > "$R/racecheck.log" 2>&1
echo "racecheck exit $?"; tail -4 "$R/racecheck.log"
el "done"
