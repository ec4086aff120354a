#!/usr/bin/env bash
# cuda_paged GPU job (issue 6): build (sm_90 only); correctness of the kernel variants not yet
# measured (pipelined prefills incl. the fast-softmax ones, ring decode) against the torch
# reference on a NaN-poisoned cache; timings of every variant with copy bandwidth and SDPA in
# the same run; conformance (full, with the shipped defaults); memcheck; racecheck of the
# shipped prefill; the measured kernels' sweep; CUDA graphs. Most important first; each
# step under its own timeout (about 270 s in all on an H200, 320 s at most).
# Usage (repo root): bash backends/cuda_paged/bench/gpu_job.sh RESULT_DIR
# CUDA_PAGED_JOB=mid: build, correctness of the candidate prefills ($CANDIDATES) and the
# prefill timings only (about 140 s), for a short batch slot.
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

CANDIDATES=mma_128_k32_3stage_fast_hm,mma_128_k32_4stage_fast_hm,mma_64_k32_3stage_fast_hm
CANDIDATES=$CANDIDATES,mma_128_k32_3stage_fast,mma_128_fast,mma_128_fast_hm
if [[ ${CUDA_PAGED_JOB:-full} == mid ]]; then
  el "check candidate prefills: $CANDIDATES"
  timeout 60 python3 $B/check_gpu.py --only new --prefill "$CANDIDATES" \
    --json "$R/check_new.json" 2>&1 | tee "$R/check_new.log" | grep -v ^PASS
else
  el "check new variants (pipelined / fast prefills, ring decode)"
  timeout 75 python3 $B/check_gpu.py --only new --json "$R/check_new.json" 2>&1 \
    | tee "$R/check_new.log" | grep -v ^PASS
fi

el "bench prefill"
timeout 45 python3 $B/bench_kernels.py --sections prefill --json "$R/bench_prefill.json" 2>&1 \
  | tee "$R/bench_prefill.log" | grep -v "^  *$"

el "prefill default recommendation"
python3 - "$R" <<'PY' 2>&1 | tee "$R/prefill_pick.txt"
# Fastest prefill kernel (worst shape ratio to the shipped default) among those whose every
# check_gpu.py --only new case passed; the shipped default is DEFAULT_PREFILL_KERNEL.
import json, sys
from pagedcore_cuda_paged.plan import DEFAULT_PREFILL_KERNEL
r = sys.argv[1]
cases = json.load(open(f"{r}/check_new.json"))["cases"]
failed = {c["case"].split("prefill=PrefillKernel.")[1].split()[0].lower()
          for c in cases if not c["ok"] and "prefill=PrefillKernel." in c["case"]}
ms = {}
for row in json.load(open(f"{r}/bench_prefill.json"))["prefill"]:
    if "ms" in row:
        ms.setdefault(row["impl"].split("/")[1], {})[row["shape"]] = row["ms"]
base = ms[DEFAULT_PREFILL_KERNEL.value]
score = {k: max(v[s] / base[s] for s in base) for k, v in ms.items()
         if set(v) == set(base) and k not in failed}
best = min(score, key=score.get)
print(f"failed checks: {sorted(failed) or 'none'}; worst-shape time ratio to the default "
      f"{DEFAULT_PREFILL_KERNEL.value}: " + ", ".join(f"{k} {v:.3f}" for k, v in
                                                   sorted(score.items(), key=lambda x: x[1])))
print(f"RECOMMENDED DEFAULT_PREFILL_KERNEL: {best}"
      + (" (the shipped one)" if best == DEFAULT_PREFILL_KERNEL.value else
         f" -> set DEFAULT_PREFILL_KERNEL = PrefillKernel.{best.upper()} in plan.py"))
PY

if [[ ${CUDA_PAGED_JOB:-full} == mid ]]; then
  el "prefill bench again (run-to-run spread)"
  timeout 40 python3 $B/bench_kernels.py --sections prefill --json "$R/bench_prefill2.json" \
    2>&1 | grep -E "shape=" | sed -E 's/ (batch|prefix|len|sdpa_ms|sdpa_tflops)=[^ ]+//g'
  el "done (mid)"; exit 0
fi

el "conformance (full, shipped defaults)"
timeout 25 python3 -m pagedcore.cli conformance cuda_paged --json "$R/conformance.json" \
  > "$R/conformance.log" 2>&1
echo "conformance rc=$?"; tail -3 "$R/conformance.log"

el "memcheck"
timeout 35 compute-sanitizer --tool memcheck --error-exitcode 9 python3 $B/sanitize_case.py \
  > "$R/memcheck.log" 2>&1
echo "memcheck exit $?"; tail -3 "$R/memcheck.log"

el "racecheck (the shipped multi-stage prefill)"
timeout 40 compute-sanitizer --tool racecheck --error-exitcode 9 python3 $B/sanitize_case.py \
  --prefill-only --default-only > "$R/racecheck.log" 2>&1
echo "racecheck exit $?"; tail -3 "$R/racecheck.log"

el "bench decode + mixed"
timeout 30 python3 $B/bench_kernels.py --sections decode,mixed --json "$R/bench_decode.json" \
  2>&1 | tee "$R/bench_decode.log" | grep -v "^  *$"

el "check measured kernels (defaults, MMA / MMA_128 prefill, decode unroll 1/2)"
timeout 25 python3 $B/check_gpu.py --only old_mma --json "$R/check_mma.json" 2>&1 \
  | tee "$R/check_mma.log" | grep -v ^PASS

el "cuda graphs"
timeout 12 python3 $B/check_gpu.py --graphs > "$R/graphs.log" 2>&1; echo "graphs rc=$?"
tail -2 "$R/graphs.log"
el "done"
