#!/bin/bash
# One GPU call: install, correctness on the GPU, tuning sweep, then the kernel bench.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-build-isolation --no-deps -e . -e backends/triton 2>&1 | tail -3
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv
timeout 150 python3 -m pytest backends/triton/tests -q 2>&1 | tail -8 | tee "$OUT/pytest.log"
timeout 150 python3 -m pagedcore.cli conformance triton 2>&1 | tee "$OUT/conformance.log"
if [ "${TUNE:-1}" = 1 ]; then
  timeout 200 python3 backends/triton/tools/tune_h200.py "$OUT/tune.json" 2>&1 | tee "$OUT/tune.log"
fi
timeout 200 python3 -m pagedcore.cli bench kernels --backend triton --json "$OUT/triton_h200.json" 2>&1 \
  | tee "$OUT/bench.log"
if [ -n "${GIT_COMMIT:-}" ] && [ -f "$OUT/triton_h200.json" ]; then
  python3 - "$OUT/triton_h200.json" <<'PY'
import json, os, sys
d = json.load(open(sys.argv[1]))
if not d.get("git_commit"):
    d["git_commit"] = os.environ["GIT_COMMIT"] + " (plus the uncommitted working tree of the run)"
json.dump(d, open(sys.argv[1], "w"), indent=2)
PY
fi
