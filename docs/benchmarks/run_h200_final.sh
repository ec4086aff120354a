#!/bin/bash
# The combined H200 run whose JSON is committed beside this script: install, conformance on the
# GPU, kernel bench, engine bench. One device call, about 7 minutes.
#   bash docs/benchmarks/run_h200_final.sh        ($OUT: where results go)
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/pagedcore_h200}; mkdir -p "$OUT"
# The GPU image's python3 may lack the small pure-Python deps: carry them as wheels in .whl/.
if ! python3 -c "import attrs, pluggy, click, rich" 2>/dev/null && [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-build-isolation --no-deps -e . -e backends/triton \
  -e docs/examples/toy_backend 2>&1 | tail -3
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv

timeout 110 python3 -m pagedcore.cli conformance triton --json "$OUT/conformance_triton_h200.json" 2>&1 | tail -35
timeout 45 python3 -m pagedcore.cli conformance triton_mla --json "$OUT/conformance_triton_mla_h200.json" 2>&1 | tail -12
timeout 30 python3 -m pagedcore.cli conformance reference --device cuda --quick 2>&1 | tail -4
timeout 110 python3 -m pagedcore.cli bench kernels --backend triton --json "$OUT/kernels_h200.json" 2>&1 | tail -25
timeout 180 python3 -m pagedcore.cli bench engine --backend triton --big-num-prompts 256 --stress-requests 400 \
  --json "$OUT/engine_h200.json" 2>&1 | tail -30
