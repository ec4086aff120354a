#!/usr/bin/env bash
# GPU check of the flex backend (run on the H200 from the repo root, backends installed):
#   OUT=/some/dir bash backends/flex/tools/gpu_check.sh [all|recompile|conformance|bench]
# Writes recompiles_flex.txt, conformance_flex_h200.json, bench_kernels_flex_triton_h200.json.
# Each conformance case compiles flex for its shapes (~10-40 s each on first use), so run the
# stages as separate commands if one command has a time limit; the inductor cache below makes
# a second run on the same machine much faster.
set -uo pipefail
OUT=${OUT:?set OUT to a writable directory}
STAGE=${1:-all}
mkdir -p "$OUT"
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/pagedcore_flex_inductor}
python -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
pagedcore backends | grep -E "flex|triton" || true
if [[ $STAGE == all || $STAGE == recompile ]]; then
  echo "== recompiles within one bucket, and the gather's share of a forward"
  python backends/flex/tools/recompile_check.py 2>&1 | tee "$OUT/recompiles_flex.txt"
fi
if [[ $STAGE == all || $STAGE == conformance ]]; then
  echo "== full conformance"
  time pagedcore conformance flex --json "$OUT/conformance_flex_h200.json"
fi
if [[ $STAGE == all || $STAGE == bench ]]; then
  echo "== kernels bench, flex beside triton"
  time pagedcore bench kernels --backend flex --backend triton \
    --json "$OUT/bench_kernels_flex_triton_h200.json"
fi
