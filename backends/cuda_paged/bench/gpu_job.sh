#!/usr/bin/env bash
# cuda_paged GPU job (issue 6), most important first, each step under its own timeout (about
# 250 s in all on an H200; run it under a 290 s cap):
#   build (sm_90 only); correctness of the candidate prefills ($CANDIDATES) against the torch
#   reference on a NaN-poisoned cache; prefill timings of the candidates vs SDPA; the pick
#   (bench/pick_prefill.py: faster than the shipped default at 4x2048 and 4x8192, every check
#   passed), written into the INSTALLED copy of plan.py on this machine only, so that what
#   follows runs with the default we would ship: full conformance; compute-sanitizer memcheck
#   and racecheck of the shipped kernels (decode one pass / partitioned + reduce, prefill,
#   cache write: sanitize_case.py --defaults); the prefill timings again (run-to-run spread,
#   the pick over both runs); memcheck of every kernel variant; the defaults on every dtype /
#   head size / block size.
# Usage (repo root): bash backends/cuda_paged/bench/gpu_job.sh RESULT_DIR
# CUDA_PAGED_JOB=mid: build, candidate checks and prefill timings only (about 120 s).
# CUDA_PAGED_KEEP_DEFAULT=1: time and check, but run the rest with the shipped default.
set -o pipefail
R=${1:?usage: gpu_job.sh RESULT_DIR}
mkdir -p "$R"
export PYTHONUNBUFFERED=1 MAX_JOBS=16 PAGEDCORE_CUDA_PAGED_ARCHS=90
B=backends/cuda_paged/bench
T0=$(date +%s)
el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }

el "build"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
timeout 130 python3 -m pip install -v --no-build-isolation --no-deps ./backends/cuda_paged \
  > "$R/build.log" 2>&1
el "build rc=$?"
grep -E "pagedcore-cuda-paged:|error" "$R/build.log" | head -20
python3 -c "import torch, pagedcore_cuda_paged._C as c; print('extension', c.__file__)" || {
  grep -iE "error|warning: " "$R/build.log" | head -40; tail -30 "$R/build.log"; exit 1; }
git rev-parse HEAD > "$R/commit.txt" 2>/dev/null; git status --short -- csrc backends/cuda_paged \
  >> "$R/commit.txt" 2>/dev/null

CANDIDATES=mma_128_fast,mma_128_fast_hm,mma_128_fast_wm,mma_128_fast_hm_wm,mma_128_fast_wm_1b
CANDIDATES=$CANDIDATES,mma_128_fast_wmp,mma_128_fast_wmp_1b
TIMED=$CANDIDATES,mma_128_k32_3stage_fast_hm
el "check candidate prefills: $CANDIDATES"
timeout 50 python3 $B/check_gpu.py --only new --prefill "$CANDIDATES" \
  --json "$R/check_new.json" 2>&1 | tee "$R/check_new.log" | grep -v ^PASS

el "bench prefill: $TIMED"
timeout 40 python3 $B/bench_kernels.py --sections prefill --kernels "$TIMED" \
  --json "$R/bench_prefill.json" 2>&1 | tee "$R/bench_prefill.log" \
  | grep -E "shape=" | sed -E 's/ (batch|prefix|len|sdpa_ms)=[^ ]+//g'

el "prefill default pick"
timeout 20 python3 $B/pick_prefill.py "$R/check_new.json" "$R/bench_prefill.json" 2>&1 \
  | tee "$R/prefill_pick.txt"
PICK=$(awk '$1 == "PICK" {print $2}' "$R/prefill_pick.txt")
if [[ -n $PICK && ${CUDA_PAGED_KEEP_DEFAULT:-0} != 1 && ${CUDA_PAGED_JOB:-full} != mid ]]; then
  PLAN=$(python3 -c "import pagedcore_cuda_paged.plan as p; print(p.__file__)")
  sed -i -E "s/^DEFAULT_PREFILL_KERNEL = PrefillKernel\.[A-Z0-9_]+$/DEFAULT_PREFILL_KERNEL = PrefillKernel.${PICK^^}/" "$PLAN"
fi
python3 -c "from pagedcore_cuda_paged.plan import DEFAULT_PREFILL_KERNEL as d; print(d.value)" \
  | tee "$R/default_used.txt"
el "default prefill for the rest of this run: $(cat "$R/default_used.txt")"

if [[ ${CUDA_PAGED_JOB:-full} == mid ]]; then
  el "prefill bench again (run-to-run spread)"
  timeout 40 python3 $B/bench_kernels.py --sections prefill --kernels "$TIMED" \
    --json "$R/bench_prefill2.json" 2>&1 | grep -E "shape=" \
    | sed -E 's/ (batch|prefix|len|sdpa_ms|sdpa_tflops)=[^ ]+//g'
  el "done (mid)"; exit 0
fi

el "conformance (full, default $(cat "$R/default_used.txt"))"
timeout 30 python3 -m pagedcore.cli conformance cuda_paged --json "$R/conformance.json" \
  > "$R/conformance.log" 2>&1
echo "conformance rc=$?"; tail -3 "$R/conformance.log"

el "memcheck (shipped defaults)"
timeout 40 compute-sanitizer --tool memcheck --error-exitcode 9 python3 $B/sanitize_case.py \
  --defaults > "$R/memcheck_defaults.log" 2>&1
echo "memcheck defaults exit $?"; grep -E "shipped|rel errors|ERROR SUMMARY" "$R/memcheck_defaults.log"

el "racecheck (shipped defaults)"
timeout 75 compute-sanitizer --tool racecheck --error-exitcode 9 python3 $B/sanitize_case.py \
  --defaults > "$R/racecheck_defaults.log" 2>&1
echo "racecheck defaults exit $?"; grep -E "shipped|rel errors|RACECHECK SUMMARY|hazard" \
  "$R/racecheck_defaults.log" | head -8

el "bench prefill again (run-to-run spread) and the pick over both runs"
timeout 40 python3 $B/bench_kernels.py --sections prefill --kernels "$TIMED" \
  --json "$R/bench_prefill2.json" 2>&1 | tee "$R/bench_prefill2.log" | grep -E "shape=" \
  | sed -E 's/ (batch|prefix|len|sdpa_ms)=[^ ]+//g'
timeout 20 python3 $B/pick_prefill.py "$R/check_new.json" "$R/bench_prefill.json" \
  "$R/bench_prefill2.json" 2>&1 | tee "$R/prefill_pick_both.txt" | tail -3

el "memcheck (every kernel variant)"
timeout 45 compute-sanitizer --tool memcheck --error-exitcode 9 python3 $B/sanitize_case.py \
  > "$R/memcheck_all.log" 2>&1
echo "memcheck all exit $?"; grep -E "rel errors|ERROR SUMMARY" "$R/memcheck_all.log"

el "check the defaults on every dtype / head / block size (and the older mma kernels)"
timeout 30 python3 $B/check_gpu.py --only old_mma --json "$R/check_mma.json" 2>&1 \
  | tee "$R/check_mma.log" | grep -v ^PASS
el "done"
