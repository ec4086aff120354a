#!/usr/bin/env bash
# One timed GPU round for cascade attention (issue #26), inside a hard wall-clock cap:
# the kernel bench's target step and where its time goes (prefix launch, suffix launch with
# its fused merge, prefix-shape variants), then the triton shared-prefix conformance cases.
# Each step gets `timeout` from GPU_DEADLINE; results land in OUT_DIR as they finish.
#
#   OUT_DIR=/tmp/o GPU_DEADLINE=$(( $(date +%s) + 60 )) bash docs/benchmarks/cascade_gpu.sh
#   bash docs/benchmarks/cascade_gpu.sh --smoke     # CPU, Triton's interpreter, tiny shapes
set -uo pipefail
OUT=${OUT_DIR:-${OUT:-/tmp/cascade_out}}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
DEADLINE=${GPU_DEADLINE:-$(( $(date +%s) + 600 ))}
left() { echo $(( DEADLINE - $(date +%s) - ${1:-3} )); }
VARIANTS=${CASCADE_VARIANTS:-"128,64,4,3,1;64,64,4,3,2;128,64,8,3,2;128,32,8,3,1"}
if [[ "${1:-}" == "--smoke" ]]; then
    export TRITON_INTERPRET=1
    bench=(--smoke --variants "16,16,4,1,2")
    conf=(--quick --device cpu -k shared_decode/float32/hs128/bs16/h8kv2/out_buffer)
else
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu.txt" || true
    bench=(--variants "$VARIANTS")
    conf=(--device cuda -k shared_)
fi
echo "start $(date +%s) deadline $DEADLINE" | tee "$OUT/steps.txt"
t=$(left 25)
if (( t > 5 )); then
    timeout "$t" "$PY" backends/triton/tools/cascade_bench.py "${bench[@]}" \
        --parts target,components --json "$OUT/cascade_kernels.json" \
        > "$OUT/cascade_bench.txt" 2>&1
    echo "bench rc=$? at $(date +%s)" | tee -a "$OUT/steps.txt"
fi
tail -n 8 "$OUT/cascade_bench.txt"
t=$(left 2)
if (( t > 5 )); then
    timeout "$t" "$PY" -m pagedcore.cli conformance triton "${conf[@]}" \
        --json "$OUT/cascade_conformance.json" > "$OUT/cascade_conformance.txt" 2>&1
    echo "conformance rc=$? at $(date +%s)" | tee -a "$OUT/steps.txt"
fi
tail -n 3 "$OUT/cascade_conformance.txt"
exit 0
