#!/usr/bin/env bash
# GPU check of the flex backend (run on the H200, repo root, with the backends installed):
#   OUT=/some/dir bash backends/flex/tools/gpu_check.sh
# Writes conformance_flex_h200.json, bench_kernels_flex_triton_h200.json, recompiles_flex.txt.
set -uo pipefail
OUT=${OUT:?set OUT to a writable directory}
mkdir -p "$OUT"
python -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
pagedcore backends | grep -E "flex|triton" || true
echo "== recompiles within one bucket, and the gather's share of a forward"
python backends/flex/tools/recompile_check.py 2>&1 | tee "$OUT/recompiles_flex.txt"
echo "== full conformance"
time pagedcore conformance flex --json "$OUT/conformance_flex_h200.json"
echo "== kernels bench, flex beside triton"
time pagedcore bench kernels --backend flex --backend triton \
  --json "$OUT/bench_kernels_flex_triton_h200.json"
