#!/usr/bin/env bash
# cuda_paged fp8 decode on the grouped tensor-core kernel (issue 24), about 200 s on the H200:
# build the extension (sm_90), the whole conformance suite on CUDA, the fp8 grid
# (gpu/fp8_grid.py: head / block sizes, GQA groups, batches, both fp8 formats, both query
# dtypes), the decode kernel bench in bf16 (auto), e4m3 and e5m2 in one process each, and a
# compute-sanitizer memcheck of an fp8 decode case. Results in $OUT.
# Usage (repo root): OUT=/some/dir bash gpu/fp8_mma.sh
set -o pipefail
R=${OUT:?set OUT to the result directory}
mkdir -p "$R"
export PYTHONUNBUFFERED=1 MAX_JOBS=16 PAGEDCORE_CUDA_PAGED_ARCHS=90
T0=$(date +%s)
el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
el build
timeout 240 python3 -m pip install -v --no-build-isolation --no-deps ./backends/cuda_paged \
  > "$R/build.log" 2>&1
el "build rc=$?"
python3 -c "import torch, pagedcore_cuda_paged._C as c; print('extension', c.__file__)" \
  || { grep -iE "error" "$R/build.log" | head -40; exit 1; }
timeout 100 python3 -m pagedcore.cli conformance cuda_paged --device cuda \
  --json "$R/conformance.json" > "$R/conformance.log" 2>&1
el "conformance rc=$?"; tail -2 "$R/conformance.log"
timeout 60 python3 gpu/fp8_grid.py "$R/fp8_grid.json" > "$R/fp8_grid.log" 2>&1
el "fp8 grid rc=$?"; tail -3 "$R/fp8_grid.log"
for kv in auto fp8 fp8_e5m2; do
  timeout 40 python3 -m pagedcore.cli bench kernels --backend cuda_paged --case decode \
    --kv-cache-dtype $kv --json "$R/bench_decode_$kv.json" > "$R/bench_decode_$kv.log" 2>&1
  el "bench $kv rc=$?"
done
timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pagedcore.cli \
  conformance cuda_paged --device cuda -k decode/float16/hs128/bs16/h8kv2/fp8_e4m3 \
  > "$R/memcheck.log" 2>&1
el "memcheck rc=$?"; tail -2 "$R/memcheck.log"
