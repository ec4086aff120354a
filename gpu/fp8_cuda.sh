#!/usr/bin/env bash
# cuda_paged fp8 KV cache on the H200 (issue 24), about 150 s: build the extension (sm_90), the
# conformance suite's fp8 cases on CUDA (-k fp8), then the decode kernel bench with an fp8
# cache and in bf16 (auto) for comparison, then a compute-sanitizer memcheck of one fp8 step.
# Each step under its own timeout; results in $OUT.
# Usage (repo root): OUT=/some/dir bash gpu/fp8_cuda.sh
set -o pipefail
R=${OUT:?set OUT to the result directory}
mkdir -p "$R"
export PYTHONUNBUFFERED=1 MAX_JOBS=16 PAGEDCORE_CUDA_PAGED_ARCHS=90
T0=$(date +%s)
el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
git rev-parse HEAD > "$R/commit.txt" 2>/dev/null

el "build"
timeout 110 python3 -m pip install -v --no-build-isolation --no-deps ./backends/cuda_paged \
  > "$R/build.log" 2>&1
el "build rc=$?"
python3 -c "import torch, pagedcore_cuda_paged._C as c; print('extension', c.__file__, \
  hasattr(c, 'decode_fp8'))" 2>&1 | tee "$R/ext.txt" || {
  grep -iE "error" "$R/build.log" | head -40; tail -30 "$R/build.log"; exit 1; }

el "conformance fp8 (cuda)"
timeout 60 python3 -m pagedcore.cli conformance cuda_paged --device cuda -k fp8 --progress \
  --json "$R/conformance_fp8.json" > "$R/conformance_fp8.log" 2>&1
el "conformance rc=$?"
tail -25 "$R/conformance_fp8.log"

el "bench decode fp8"
timeout 35 python3 -m pagedcore.cli bench kernels --backend cuda_paged --case decode \
  --kv-cache-dtype fp8 --json "$R/bench_decode_fp8.json" > "$R/bench_decode_fp8.log" 2>&1
el "bench fp8 rc=$?"
tail -15 "$R/bench_decode_fp8.log"

el "bench decode bf16 (auto)"
timeout 35 python3 -m pagedcore.cli bench kernels --backend cuda_paged --case decode \
  --json "$R/bench_decode_auto.json" > "$R/bench_decode_auto.log" 2>&1
el "bench auto rc=$?"
tail -15 "$R/bench_decode_auto.log"
el "memcheck of one mixed fp8 step (cache write, decode_fp8, prefill_fp8), last: optional"
timeout 40 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pagedcore.cli \
  conformance cuda_paged --device cuda -k mixed/float16/hs128/bs16/h8kv2/fp8_e4m3 \
  > "$R/memcheck_fp8.log" 2>&1
el "memcheck rc=$?"
tail -8 "$R/memcheck_fp8.log"
el "done"
