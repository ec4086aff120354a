#!/usr/bin/env bash
# The flashinfer backend on a GPU machine without a registry (the H200), in one call (< 10 min).
#
#   OUT=/some/dir WHL=.whl bash backends/flashinfer/tools/gpu_check.sh      (from the repo root)
#
# WHL holds what install_offline.sh download made (the lead's .whl/). Steps, each logged to
# $OUT/<step>.log and timed in $OUT/steps.txt; a failing step does not stop the next:
#   install  FlashInfer into /tmp/fi_target (install_offline.sh), pagedcore + backends -e
#   warm     JIT-build every kernel variant the conformance suite needs, in parallel
#            (one `pagedcore conformance flashinfer -k CASE` process per variant)
#   full     `pagedcore conformance flashinfer --json $OUT/conformance_flashinfer_h200.json`
#   mla      the same for flashinfer_mla, when that backend is registered
#   bench    `pagedcore bench kernels` for both mixed-step modes (PAGEDCORE_FLASHINFER_MIXED=split
#            and =prefill), FlashInfer beside Triton: $OUT/kernels_split.json, kernels_prefill.json
# STEPS="install full" runs a subset (install is needed once per machine; the JIT cache under
# ~/.cache/flashinfer lives as long as the machine).
set -x
OUT=${OUT:?set OUT to a result directory}
WHL=${WHL:-.whl}
STEPS=${STEPS:-"install warm full mla bench"}
TARGET=${FI_TARGET:-/tmp/fi_target}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T0=$(date +%s)
PY=python3

step() {  # step NAME TIMEOUT_S CMD...: run CMD with a time cap, log it, never abort the script
  local name=$1 cap=$2; shift 2
  local t=$(date +%s)
  timeout -k 5 "$cap" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - t ))s (at +$(( $(date +%s) - T0 ))s)" | tee -a "$OUT/steps.txt"
  tail -5 "$OUT/$name.log"
  return 0
}
has() { [[ " $STEPS " == *" $1 "* ]]; }

if has install; then
  step install_flashinfer 120 bash backends/flashinfer/tools/install_offline.sh install "$WHL" "$TARGET"
  step install_pagedcore 120 $PY -m pip install --no-deps --no-build-isolation \
    -e . -e backends/triton -e backends/flashinfer
fi
# The exports install_offline.sh prints (repeated here so that STEPS without install work).
export PYTHONPATH=$TARGET${PYTHONPATH:+:$PYTHONPATH}
export PATH=$TARGET/bin:$PATH
export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0}
$PY -c "import torch, flashinfer; print('torch', torch.__version__, 'flashinfer', flashinfer.__version__, torch.cuda.get_device_name())" > "$OUT/versions.txt" 2>&1
cat "$OUT/versions.txt"
$PY -m pagedcore.cli backends > "$OUT/backends.txt" 2>&1; cat "$OUT/backends.txt"

if has warm; then
  # One process per distinct kernel variant (dtype, head size, window, soft-cap); FlashInfer
  # locks its JIT build directories, so overlapping builds are safe.
  i=0
  for case in mixed/float16/hs128/bs16/h8kv2 mixed/bfloat16 hs64 hs256 window8 softcap1 \
      window11/softcap2; do
    i=$((i + 1))
    step "warm_$i" 420 $PY -m pagedcore.cli conformance flashinfer -k "$case" &
  done
  wait
fi
if has full; then
  step conformance_flashinfer 420 $PY -m pagedcore.cli conformance flashinfer \
    --json "$OUT/conformance_flashinfer_h200.json"
fi
if has mla; then
  if grep -q flashinfer_mla "$OUT/backends.txt"; then
    step conformance_flashinfer_mla 300 $PY -m pagedcore.cli conformance flashinfer_mla \
      --json "$OUT/conformance_flashinfer_mla_h200.json"
  else
    echo "mla: no flashinfer_mla backend registered; skipped" | tee -a "$OUT/steps.txt"
  fi
fi
if has bench; then
  PAGEDCORE_FLASHINFER_MIXED=split step bench_split 240 $PY -m pagedcore.cli bench kernels \
    --backend flashinfer --backend triton --json "$OUT/kernels_split.json"
  PAGEDCORE_FLASHINFER_MIXED=prefill step bench_prefill 240 $PY -m pagedcore.cli bench kernels \
    --backend flashinfer --json "$OUT/kernels_prefill.json"
fi
echo "done at +$(( $(date +%s) - T0 ))s" | tee -a "$OUT/steps.txt"
