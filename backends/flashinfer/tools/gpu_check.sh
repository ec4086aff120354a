#!/usr/bin/env bash
# The FlashInfer GPU checks on a machine without a registry (the H200), in one call of ~420 s.
#
#   OUT=/some/dir WHL=.whl bash backends/flashinfer/tools/gpu_check.sh      (from the repo root)
#
# WHL holds what install_offline.sh download made. Each step is logged to $OUT/r/<step>.log and
# timed in $OUT/r/steps.txt (written as it goes: a run killed at its cap keeps every finished
# step); a failing step does not stop the next. The JIT builds are split so the most important
# results come first (FlashInfer builds a module per kernel variant; `tools/prebuild_jit.py`
# builds a list of them in one ninja pass):
#   install    FlashInfer into /tmp/fi_target, pagedcore + backends -e                (~15 s)
#   prebuild   phase A, all cores: the FA2 module of each of the 7 conformance variants
#              (linked into FlashInfer's AOT directory, `--as-aot`: loaded, not rebuilt)
#              then, in the background, phase B1 (the 2 MLA modules, bf16/hs64 FA2 for the
#              engine bench) and B2 (FA3 for float16/hs128 and bfloat16/hs64)
#   full       `pagedcore conformance flashinfer` with PAGEDCORE_FLASHINFER_PREFILL=fa2,
#              beside it `graphs`: decode CUDA graphs over FlashInfer's use_cuda_graph
#              wrappers vs eager (pytest test_flashinfer_engine.py -k real)
#   mla        `pagedcore conformance flashinfer_mla` (beside `full` too, once B1 is built)
#   (timings from here on, one at a time on the GPU)
#   benchmla   `pagedcore bench mla --backend triton_mla --backend flashinfer_mla` (small set)
#   engine     `pagedcore bench engine --only throughput` at one shape with triton, then
#              flashinfer with decode graphs (tools/engine_graphs.py, which declares them
#              whatever backend.py says) and eager, with a graphs-vs-eager parity check
#   fa3        the float16/hs128 cases without window / soft-cap on the default kernels (FA3;
#              waits for B2), then the flashinfer engine bench with FA3 prefill
#   flex       the engine bench with flex forced, if time is left
#   (a short rerun: STEPS="install prebuild_small graphs engine_fi" builds the two head-size-64
#   FA2 modules only, then the graphs test and the flashinfer engine bench with graphs)
#   (the fp8 cache: STEPS="install prebuild_fp8 conf_fp8 engine_fp8 bench_fp8" builds the FA2
#   modules of the fp8 conformance cases, the fp8 engine test and the decode bench in one
#   pass, runs `pagedcore conformance flashinfer -k fp8`, test_flashinfer_fp8.py's GPU tests,
#   then `bench kernels --case decode` with triton and flashinfer at auto / e4m3 / e5m2;
#   `bench_fp8_prefill` adds `--case prefill` at auto / e4m3 with FlashInfer on FA2)
# STEPS="install prebuild full" runs a subset; CAP_<STEP>=seconds overrides a step's cap;
# BUDGET (default 405) is the script's own deadline in seconds: every cap is cut to what is left.
set -u
OUT=${OUT:?set OUT to a result directory}
WHL=${WHL:-.whl}
STEPS=${STEPS:-"install prebuild full graphs mla benchmla engine fa3 flex"}
TARGET=${FI_TARGET:-/tmp/fi_target}
BUDGET=${BUDGET:-405}
R=$OUT/r
mkdir -p "$R"
export PYTHONUNBUFFERED=1 FLASHINFER_CUDA_ARCH_LIST=9.0 MAX_JOBS=${MAX_JOBS:-16}
export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-2}
T0=$(date +%s)
PY=python3
TOOLS=backends/flashinfer/tools

left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
step() {  # step NAME CAP CMD...: run CMD with a time cap (cut to what is left), log it
  local name=$1 cap=$2; shift 2
  local var="CAP_${name^^}"; cap=${!var:-$cap}
  local rest; rest=$(left)
  (( rest < cap )) && cap=$rest
  if (( cap < 10 )); then
    echo "$name skipped: ${rest}s left (at +$(( $(date +%s) - T0 ))s)" | tee -a "$R/steps.txt"
    return 0
  fi
  local t; t=$(date +%s)
  timeout -k 5 "$cap" "$@" > "$R/$name.log" 2>&1 &
  local pid=$!
  [[ -n "${PIDFILE:-}" ]] && echo "$pid" > "$PIDFILE"
  wait "$pid"
  local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - t ))s cap=${cap}s (at +$(( $(date +%s) - T0 ))s)" \
    | tee -a "$R/steps.txt"
  tail -3 "$R/$name.log"
  return 0
}
has() { [[ " $STEPS " == *" $1 "* ]]; }
wait_for() {  # wait_for FILE: until a background phase wrote FILE, or the budget runs out
  while [[ ! -e "$1" ]] && (( $(left) > 10 )); do sleep 1; done
  [[ -e "$1" ]] && echo "$(basename "$1") ready at +$(( $(date +%s) - T0 ))s" >> "$R/steps.txt"
}
CONF="$PY -m pagedcore.cli conformance"
ENGINE="bench engine --only throughput --num-prompts 32 --max-new 32 --skip-hf --skip-eager"

if has install; then
  step install_flashinfer 60 bash -c "bash $TOOLS/install_offline.sh install '$WHL' \
    '$TARGET' > /dev/null"
  step install_pagedcore 60 $PY -m pip install -q --no-deps --no-build-isolation \
    -e . -e backends/triton -e backends/flashinfer -e backends/flex
fi
export PYTHONPATH=$TARGET${PYTHONPATH:+:$PYTHONPATH} PATH=$TARGET/bin:$PATH
$PY -c "import torch, flashinfer; print('torch', torch.__version__, 'flashinfer', \
flashinfer.__version__, torch.cuda.get_device_name())" > "$R/versions.txt" 2>&1
cat "$R/versions.txt"
nproc >> "$R/versions.txt"

B1=$R/prebuild_b1.done B2=$R/prebuild_b2.done
if has prebuild; then
  step prebuild_a 150 $PY $TOOLS/prebuild_jit.py --prefill fa2 --as-aot
  # Niced, on 14 of the 16 cores: the runs beside it keep a core and the CPU first.
  (
    PIDFILE=$R/bg.pid MAX_JOBS=14 step prebuild_b1 120 nice -n 10 $PY $TOOLS/prebuild_jit.py \
      --no-conformance --mla --extra bfloat16:64 --as-aot
    touch "$B1"
    PIDFILE=$R/bg.pid MAX_JOBS=14 step prebuild_b2 200 nice -n 10 $PY $TOOLS/prebuild_jit.py \
      --no-conformance --prefill fa2,fa3 --extra float16:128 --extra bfloat16:64 \
      --skip kv_stride_equal --as-aot
    touch "$B2"
  ) &
  bg_pid=$!
elif has prebuild_small; then  # a short rerun: the two head-size-64 FA2 modules only
  step prebuild_small 60 $PY $TOOLS/prebuild_jit.py --no-conformance --extra float16:64 \
    --extra bfloat16:64 --as-aot
  touch "$B1" "$B2"
else
  touch "$B1" "$B2"
fi
$PY -m pagedcore.cli backends > "$R/backends.txt" 2>&1

if has graphs; then
  # Tiny model (fp16, head size 64: a phase-A module); runs beside the full suite.
  step graphs 90 $PY -m pytest -q -p no:cacheprovider -rs \
    backends/flashinfer/tests/test_flashinfer_engine.py -k real &
  graphs_pid=$!
fi
if has mla; then  # beside the full suite too, once its modules (B1) are built
  ( wait_for "$B1"
    step mla 90 $CONF flashinfer_mla --progress --json "$R/conformance_flashinfer_mla_h200.json"
  ) &
  mla_pid=$!
fi
if has full; then
  PAGEDCORE_FLASHINFER_PREFILL=fa2 step full 150 $CONF flashinfer --progress \
    --json "$R/conformance_flashinfer_fa2_h200.json"
fi
[[ -n "${graphs_pid:-}" ]] && wait "$graphs_pid"
[[ -n "${mla_pid:-}" ]] && wait "$mla_pid"
# Timings from here on: nothing else on the GPU (the niced B2 build may still use the CPUs).
if has benchmla; then
  step benchmla 60 $PY -m pagedcore.cli bench mla --backend triton_mla \
    --backend flashinfer_mla --json "$R/mla_backends_h200.json"
fi
if has engine; then
  step engine_triton 75 $PY -m pagedcore.cli $ENGINE --backend triton \
    --json "$R/engine_triton.json"
  # With decode graphs (declared for the run even where backend.py does not), then eager,
  # with a graphs-vs-eager parity check.
  PAGEDCORE_FLASHINFER_PREFILL=fa2 step engine_flashinfer_graphs 100 $PY \
    $TOOLS/engine_graphs.py bench engine --only parity,throughput --num-prompts 32 \
    --max-new 32 --parity-prompts 8 --skip-hf --backend flashinfer \
    --json "$R/engine_flashinfer_graphs.json"
fi
if has engine_fi; then  # a short rerun: flashinfer with decode graphs, throughput only
  # 32 prompts never need more than 32 running: 7 graph buckets instead of 35.
  PAGEDCORE_FLASHINFER_PREFILL=fa2 step engine_flashinfer_graphs 60 $PY \
    $TOOLS/engine_graphs.py $ENGINE --max-num-seqs 32 --backend flashinfer \
    --json "$R/engine_flashinfer_graphs.json"
fi
if has prebuild_fp8; then
  step prebuild_fp8 200 $PY $TOOLS/prebuild_jit.py -k fp8 --extra bfloat16:128 \
    --extra bfloat16:128:fp8_e5m2 --extra float16:64 --extra float16:64:fp8_e4m3 \
    --extra float16:64:fp8_e5m2 --as-aot
fi
if has conf_fp8; then
  step conf_fp8 120 $CONF flashinfer -k fp8 --progress \
    --json "$R/conformance_flashinfer_fp8.json"
fi
if has engine_fp8; then
  step engine_fp8 120 $PY -m pytest -q -p no:cacheprovider -rs \
    backends/flashinfer/tests/test_flashinfer_fp8.py -k real
fi
if has bench_fp8; then
  for kv in auto fp8_e4m3 fp8_e5m2; do
    step "bench_$kv" 100 $PY -m pagedcore.cli bench kernels --backend triton \
      --backend flashinfer --case decode --kv-cache-dtype "$kv" \
      --json "$R/kernels_decode_${kv}.json"
  done
fi
if has bench_fp8_prefill; then  # FA2 prefill in both: the 16-bit one is the fp8 one's peer
  for kv in auto fp8_e4m3; do
    PAGEDCORE_FLASHINFER_PREFILL=fa2 step "bench_prefill_$kv" 120 $PY -m pagedcore.cli bench \
      kernels --backend triton --backend flashinfer --case prefill --kv-cache-dtype "$kv" \
      --json "$R/kernels_prefill_${kv}.json"
  done
fi
if has fa3; then
  wait_for "$B2"
  step fa3 45 $PY $TOOLS/fa3_subset.py "$R/conformance_flashinfer_fa3_base_h200.json"
  if has engine; then
    step engine_flashinfer_fa3 60 $PY $TOOLS/engine_graphs.py $ENGINE --backend flashinfer \
      --json "$R/engine_flashinfer_fa3_graphs.json"
  fi
fi
if has flex; then
  step engine_flex 60 $PY -m pagedcore.cli $ENGINE --backend flex --json "$R/engine_flex.json"
fi
if [[ -n "${bg_pid:-}" ]] && kill -0 "$bg_pid" 2> /dev/null; then
  # A build still running: stop it (timeout passes the signal on to its ninja) and the phase.
  kill "$(cat "$R/bg.pid")" 2> /dev/null
  kill "$bg_pid" 2> /dev/null
  wait "$bg_pid" 2> /dev/null
  echo "background build stopped at +$(( $(date +%s) - T0 ))s" | tee -a "$R/steps.txt"
fi
echo "done at +$(( $(date +%s) - T0 ))s" | tee -a "$R/steps.txt"
cp "$R/steps.txt" "$OUT/steps.txt"
