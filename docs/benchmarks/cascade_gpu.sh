#!/usr/bin/env bash
# One timed GPU round for issue #26 (cascade attention, cuda_paged prefill), inside a hard
# wall-clock cap. Steps (CASCADE_STEPS, comma list, in this order):
#   cascade      triton's kernel bench of the cascade target step and where its time goes
#                (prefix launch, suffix launch with its fused merge, prefix-shape variants)
#   cuda_paged   `pagedcore bench kernels --case prefill` for cuda_paged (prompts handed to
#                triton's Hopper kernel) and triton, against torch SDPA
#   engine       `pagedcore bench prefix --shared-decode-only` (llama3-8b shape, random
#                weights, eager engine: cascade off vs on)
#   conformance  triton's shared-prefix conformance cases (NaN-poisoned slots)
#   kernels      `pagedcore bench kernels --case cascade --backend triton` (the issue's form)
#   cp_conf      cuda_paged's conformance cases with prompts (prefill, mixed: the handoff)
# Each step gets `timeout` from GPU_DEADLINE; results land in OUT_DIR as they finish.
#
#   OUT_DIR=/tmp/o GPU_DEADLINE=$(( $(date +%s) + 60 )) bash docs/benchmarks/cascade_gpu.sh
#   bash docs/benchmarks/cascade_gpu.sh --smoke     # CPU, Triton's interpreter, tiny shapes
set -uo pipefail
OUT=${OUT_DIR:-${OUT:-/tmp/cascade_out}}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
DEADLINE=${GPU_DEADLINE:-$(( $(date +%s) + 600 ))}
STEPS=${CASCADE_STEPS:-cascade,engine,cuda_paged}
left() { echo $(( DEADLINE - $(date +%s) - ${1:-3} )); }
VARIANTS=${CASCADE_VARIANTS:-"128,64,4,3,1;64,64,4,3,2"}
smoke=0
if [[ "${1:-}" == "--smoke" ]]; then
    smoke=1
    export TRITON_INTERPRET=1
    bench=(--smoke --variants "16,16,4,1,2")
    conf=(--quick --device cpu -k shared_decode/float32/hs128/bs16/h8kv2/out_buffer)
else
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu.txt" || true
    bench=(--variants "$VARIANTS")
    conf=(--device cuda -k shared_)
fi
echo "start $(date +%s) deadline $DEADLINE steps $STEPS" | tee "$OUT/steps.txt"
has() { [[ ",$STEPS," == *",$1,"* ]]; }
if has cascade; then
    t=$(left 36)
    if (( t > 5 )); then
        timeout "$t" "$PY" backends/triton/tools/cascade_bench.py "${bench[@]}" \
            --parts target,components --json "$OUT/cascade_kernels.json" \
            > "$OUT/cascade_bench.txt" 2>&1
        echo "cascade rc=$? at $(date +%s)" | tee -a "$OUT/steps.txt"
    fi
    tail -n 6 "$OUT/cascade_bench.txt"
fi
if has engine && (( ! smoke )); then
    t=$(left 13)
    if (( t > 5 )); then
        timeout "$t" "$PY" -m pagedcore.cli bench prefix --model llama3-8b --shared-decode-only \
            --enforce-eager --json "$OUT/shared_decode_8b.json" > "$OUT/shared_decode_8b.txt" 2>&1
        echo "engine rc=$? at $(date +%s)" | tee -a "$OUT/steps.txt"
    fi
    tail -n 4 "$OUT/shared_decode_8b.txt"
fi
if has cuda_paged && (( ! smoke )); then
    t=$(left 12)
    if (( t > 5 )); then
        "$PY" -c "from pagedcore_cuda_paged._ext import unavailable_reason as u; print('cuda_paged:', u() or 'available')" \
            >> "$OUT/steps.txt" 2>&1
        timeout "$t" "$PY" -m pagedcore.cli bench kernels --case prefill \
            --backend cuda_paged --backend triton --json "$OUT/prefill_kernels.json" \
            > "$OUT/prefill_kernels.txt" 2>&1
        echo "cuda_paged rc=$? at $(date +%s)" | tee -a "$OUT/steps.txt"
    fi
    tail -n 12 "$OUT/prefill_kernels.txt"
fi
if has conformance; then
    t=$(left 2)
    if (( t > 5 )); then
        timeout "$t" "$PY" -m pagedcore.cli conformance triton "${conf[@]}" \
            --json "$OUT/cascade_conformance.json" > "$OUT/cascade_conformance.txt" 2>&1
        echo "conformance rc=$? at $(date +%s)" | tee -a "$OUT/steps.txt"
    fi
    tail -n 3 "$OUT/cascade_conformance.txt"
fi
if has kernels && (( ! smoke )); then
    t=$(left 2)
    if (( t > 5 )); then
        timeout "$t" "$PY" -m pagedcore.cli bench kernels --case cascade --backend triton \
            --json "$OUT/kernels_cascade.json" > "$OUT/kernels_cascade.txt" 2>&1
        echo "kernels rc=$? at $(date +%s)" | tee -a "$OUT/steps.txt"
    fi
    tail -n 6 "$OUT/kernels_cascade.txt"
fi
if has cp_conf && (( ! smoke )); then
    for k in prefill/ mixed/; do
        t=$(left 2)
        if (( t > 5 )); then
            name=${k%/}
            timeout "$t" "$PY" -m pagedcore.cli conformance cuda_paged --device cuda -k "$k" \
                --json "$OUT/cuda_paged_conformance_$name.json" \
                > "$OUT/cuda_paged_conformance_$name.txt" 2>&1
            echo "cp_conf $k rc=$? at $(date +%s)" | tee -a "$OUT/steps.txt"
            tail -n 2 "$OUT/cuda_paged_conformance_$name.txt"
        fi
    done
fi
exit 0
