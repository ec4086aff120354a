#!/usr/bin/env bash
# The last GPU round for issue #26: docs/benchmarks/cascade_round.py in one process (see it).
# OUT_DIR, GPU_DEADLINE, PAGEDCORE_GIT_COMMIT come from the round; --smoke runs on CPU.
set -uo pipefail
export OUT_DIR=${OUT_DIR:-/tmp/cascade_round}
mkdir -p "$OUT_DIR"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT_DIR/gpu.txt" 2>&1 || true
${PYTHON:-python3} docs/benchmarks/cascade_round.py "$@" 2>&1 | tail -c 200000 > "$OUT_DIR/round.log"
tail -n 30 "$OUT_DIR/round.log"
exit 0
