#!/usr/bin/env bash
# The FlashInfer / Flex GPU checks on a machine without a registry (the H200), in one call.
#
#   OUT=/some/dir WHL=.whl bash backends/flashinfer/tools/gpu_check.sh      (from the repo root)
#
# WHL holds what install_offline.sh download made. Each step is logged to $OUT/r/<step>.log and
# timed in $OUT/r/steps.txt; a failing step does not stop the next; everything under $OUT/r is
# packed into $OUT/results.tgz at the end (the device tool brings back at most 8 files).
#   install   FlashInfer into /tmp/fi_target, pagedcore + backends -e
#   prebuild  every JIT module the runs below load, in ONE ninja pass (tools/prebuild_jit.py:
#             the FA2 module of each conformance variant, FA3 only for float16/hs128, the MLA
#             modules, the engine bench's bf16/hs64), while the Flex conformance runs beside
#             everything that follows
#   full      `pagedcore conformance flashinfer` with PAGEDCORE_FLASHINFER_PREFILL=fa2
#   fa3       the float16/hs128 cases without window / soft-cap on the default kernels (FA3)
#   mla       `pagedcore conformance flashinfer_mla`
#   graphs    decode CUDA graphs over FlashInfer's use_cuda_graph wrappers vs eager (pytest
#             test_flashinfer_engine.py -k real): what declaring UNIFORM_SINGLE_TOKEN_DECODE needs
#   engine    `pagedcore bench engine` (throughput) with triton, flashinfer, flex forced
# STEPS="install prebuild full" runs a subset; CAP_<STEP>=seconds overrides a step's cap.
set -u
OUT=${OUT:?set OUT to a result directory}
WHL=${WHL:-.whl}
STEPS=${STEPS:-"install prebuild full fa3 mla graphs engine"}
TARGET=${FI_TARGET:-/tmp/fi_target}
R=$OUT/r
mkdir -p "$R"
export PYTHONUNBUFFERED=1 FLASHINFER_CUDA_ARCH_LIST=9.0 MAX_JOBS=${MAX_JOBS:-16}
export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-2}
T0=$(date +%s)
PY=python3

step() {  # step NAME CAP CMD...: run CMD with a time cap, log it, never abort the script
  local name=$1 cap=$2; shift 2
  local var="CAP_${name^^}"; cap=${!var:-$cap}
  local t; t=$(date +%s)
  timeout -k 5 "$cap" "$@" > "$R/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - t ))s (at +$(( $(date +%s) - T0 ))s)" | tee -a "$R/steps.txt"
  tail -3 "$R/$name.log"
  return 0
}
has() { [[ " $STEPS " == *" $1 "* ]]; }
CONF="$PY -m pagedcore.cli conformance"

if has install; then
  step install_flashinfer 120 bash -c "bash backends/flashinfer/tools/install_offline.sh \
    install '$WHL' '$TARGET' > /dev/null"
  step install_pagedcore 120 $PY -m pip install --no-deps --no-build-isolation \
    -e . -e backends/triton -e backends/flashinfer -e backends/flex
fi
export PYTHONPATH=$TARGET${PYTHONPATH:+:$PYTHONPATH} PATH=$TARGET/bin:$PATH
$PY -c "import torch, flashinfer; print('torch', torch.__version__, 'flashinfer', \
flashinfer.__version__, torch.cuda.get_device_name())" > "$R/versions.txt" 2>&1
cat "$R/versions.txt"
$PY -m pagedcore.cli backends > "$R/backends.txt" 2>&1

if has prebuild; then
  step flex 300 $CONF flex --progress --json "$R/conformance_flex_h200.json" &
  flex_pid=$!
  step prebuild 240 $PY backends/flashinfer/tools/prebuild_jit.py --prefill fa2,fa3 \
    --fa3-only float16:128 --mla --extra bfloat16:64
fi
if has full; then
  PAGEDCORE_FLASHINFER_PREFILL=fa2 step full 300 $CONF flashinfer --progress \
    --json "$R/conformance_flashinfer_fa2_h200.json"
fi
if has fa3; then
  step fa3 60 $PY - "$R/conformance_flashinfer_fa3_base_h200.json" <<'EOF'
import sys
from pagedcore.conformance.harness import run_case
from pagedcore.conformance.report import ConformanceReport
from pagedcore.conformance.runner import list_cases, resolve_backend

cls = resolve_backend("flashinfer")
report = ConformanceReport(backend=cls.name, device="cuda", quick=False)
for case in list_cases(cls, quick=False, device="cuda"):
    plain = case.sliding_window is None and case.logits_soft_cap is None
    if plain and case.dtype == "float16" and case.head_size == 128:
        report.results.append(run_case(cls, case, device="cuda"))
print(report.summary())
open(sys.argv[1], "w").write(report.to_json() + "\n")
EOF
fi
if has mla; then
  step mla 120 $CONF flashinfer_mla --progress --json "$R/conformance_flashinfer_mla_h200.json"
fi
if has graphs; then
  step graphs 120 $PY -m pytest -q -p no:cacheprovider -rs \
    backends/flashinfer/tests/test_flashinfer_engine.py -k real
fi
if has engine; then
  for b in triton flashinfer flex; do
    PAGEDCORE_FLASHINFER_PREFILL=fa2 step "engine_$b" 90 $PY -m pagedcore.cli bench engine \
      --backend "$b" --only throughput --num-prompts 32 --max-new 32 --skip-hf \
      --skip-eager --json "$R/engine_$b.json"
  done
fi
[[ -n "${flex_pid:-}" ]] && wait "$flex_pid"
echo "done at +$(( $(date +%s) - T0 ))s" | tee -a "$R/steps.txt"
tar -czf "$OUT/results.tgz" -C "$R" .
cp "$R/steps.txt" "$OUT/steps.txt"
