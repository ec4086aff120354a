#!/usr/bin/env bash
# Cascade attention (issue #26 item 3) on one H200, < 3 minutes: the triton backend's
# shared-prefix conformance cases (full suite's, NaN-poisoned slots), then attention time with
# and without cascade (backends/triton/tools/cascade_bench.py): the target step (64 decodes
# sharing 4,096 tokens + 256 own each), the same step with nothing shared, and the
# (requests x prefix) sweep behind pagedcore.attention.cascade's rule. Results under $OUT.
#
#   bash docs/benchmarks/run_cascade_h200.sh           # on the GPU machine, repo root
#   bash docs/benchmarks/run_cascade_h200.sh --smoke   # CPU, Triton's interpreter, tiny shapes
set -euo pipefail
OUT=${OUT:-/tmp/cascade_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if [[ "${1:-}" == "--smoke" ]]; then
    export TRITON_INTERPRET=1
    conf=(--quick --device cpu -k shared_decode/float32/hs128/bs16/h8kv2/out_buffer)
    bench=(--smoke)
else
    "$PY" -m pip install -q --no-deps --no-build-isolation -e . -e backends/triton
    "$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'"
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu.txt" || true
    conf=(--device cuda -k shared_)
    bench=()
fi
status=0
"$PY" -m pagedcore.cli conformance triton "${conf[@]}" \
    --json "$OUT/cascade_conformance.json" > "$OUT/cascade_conformance.txt" 2>&1 || status=$?
tail -n 3 "$OUT/cascade_conformance.txt"
"$PY" backends/triton/tools/cascade_bench.py "${bench[@]}" --json "$OUT/cascade_h200.json" \
    2>&1 | tee "$OUT/cascade_bench.txt"
exit "$status"
