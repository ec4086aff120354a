#!/usr/bin/env bash
# Session 30's GPU round: short queries over long contexts (issue 22's warm prefix hit), the
# H200 figures issues 22 and 24 still lack. Steps run in the order given, each under its own
# time limit; files go to $OUT/zz_raw and are packed into $OUT/round.tgz after every step (the
# device tool brings back only a few files). Repo root:
#   PAGEDCORE_GIT_COMMIT=<sha> OUT=... bash gpu/s30_round.sh [steps...]
# Steps: install build extend kernels step prefixhit conftri confcp tests
set -uo pipefail
OUT=${OUT:-/tmp/s30_round}
R=$OUT/zz_raw
mkdir -p "$R"
steps=${*:-"install build extend kernels step prefixhit"}
export PYTHONUNBUFFERED=1 MAX_JOBS=16 PAGEDCORE_CUDA_PAGED_ARCHS=90
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader > "$R/device.txt" 2>&1 || true
LOG_DIR=$R TAIL_LINES=4
source "$(dirname "$0")/round_lib.sh"
for s in $steps; do
  case $s in
    install) run install 120 python3 -m pip install --no-deps --no-build-isolation -e . -e backends/triton -e backends/flex ;;
    build) run build 300 python3 -m pip install -v --no-build-isolation --no-deps ./backends/cuda_paged ;;
    extend) run extend ${EXTEND_LIMIT:-240} python3 backends/triton/tools/extend_probe.py "$R/extend.json" \
              --seconds $(( ${EXTEND_LIMIT:-240} - 30 )) ${EXTEND_ARGS:-} ;;
    kernels) for kv in auto fp8; do
               run kernels_$kv 150 python3 -m pagedcore.cli bench kernels --backend triton --backend cuda_paged \
                 --case decode --kv-cache-dtype $kv --json "$R/kernels_$kv.json"
             done ;;
    step) run step 200 python3 -m pagedcore.cli bench step --model-shape qwen2-0.5b --batch-sizes 256 --steps 30 \
            --outputs all,deltas --no-eager --json "$R/step_qwen.json" ;;
    prefixhit) run prefixhit 200 python3 -m pagedcore.cli bench step --model-shape qwen2-0.5b --batch-sizes 1 --steps 5 \
                 --outputs finished --prefix-hit 4096 --prefix-reps 5 --profile --json "$R/prefixhit.json" ;;
    conftri) run conf_triton 300 python3 -m pagedcore.cli conformance triton --device cuda --json "$R/conformance_triton.json" ;;
    confcp) run conf_cuda_paged 200 python3 -m pagedcore.cli conformance cuda_paged --device cuda --json "$R/conformance_cuda_paged.json" ;;
    tests) run tests_gpu 300 python3 -m pytest -q -x tests/engine/test_engine_gpu.py tests/engine/test_cuda_graph.py \
             tests/engine/test_mixed_graphs.py backends/triton/tests/test_cudagraph.py backends/triton/tests/test_mixed_capture.py ;;
    *) echo "unknown step $s" ;;
  esac
  tar czf /tmp/s30_round.tgz -C "$R" . && mv /tmp/s30_round.tgz "$OUT/round.tgz"
done
exit 0
