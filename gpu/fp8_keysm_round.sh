#!/usr/bin/env bash
# cuda_paged fp8 decode, keys as the mma's M rows (issue 24), session 25. Steps run in the order
# given, each with its own time limit; files go under $OUT/zz_raw and into $OUT/round.tgz (the
# device tool brings back only a few files per call). On a fresh device machine `install` and
# `build` come first. Repo root:
#   PAGEDCORE_GIT_COMMIT=<sha> OUT=... bash gpu/fp8_keysm_round.sh [steps...]
# Steps: install build tests ncu probe probeqwen qwenbench qwensweep pick conf grid bench memcheck
# confgraph ttests tilesweep stepqwen qwentri stepdeltas conftri fusedcheck
# stepdownadd stepdownadd256
# `pick` sets KERNELS to the fastest keys variant by the probe's fp8 times (sum over the
# three shapes) for the steps after it, with `rows` for comparison in `bench`.
# PAGEDCORE_CUDA_PAGED_FP8_DECODE=rows|ring3|ring4|ring6 picks the fp8 decode kernel
# (csrc/decode_fp8_keys.cuh; ring3 is the default); the steps run each variant in $KERNELS.
# Session 25's first rounds also had `keys` / `keys3` (register rings, removed).
set -uo pipefail
OUT=${OUT:-/tmp/fp8_keysm_round}
# Files go to $OUT/zz_raw; $OUT/round.tgz (sorted first, so it is among the files returned)
# packs them after each invocation.
R=$OUT/zz_raw
mkdir -p "$R"
steps=${*:-"install build tests ncu probe conf grid bench memcheck"}
KERNELS=${KERNELS:-"rows ring3"}
export PYTHONUNBUFFERED=1 MAX_JOBS=16 PAGEDCORE_CUDA_PAGED_ARCHS=90
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader > "$R/device.txt" 2>&1 || true
LOG_DIR=$R TAIL_LINES=6
source "$(dirname "$0")/round_lib.sh"
NCU_SECTIONS="--section SpeedOfLight --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis"
for s in $steps; do
  case $s in
    install) run install 120 python3 -m pip install --no-deps --no-build-isolation -e . -e backends/triton ;;
    build) run build 300 python3 -m pip install -v --no-build-isolation --no-deps ./backends/cuda_paged ;;
    tests) run tests_engine 300 python3 -m pytest -q -x tests/engine/test_engine_gpu.py tests/engine/test_cuda_graph.py tests/engine/test_mixed_graphs.py backends/triton/tests/test_cudagraph.py backends/triton/tests/test_mixed_capture.py
           run tests_prefill_tma 200 python3 -m pytest -q backends/triton/tests/test_prefill_tma.py ;;
    ncu) for k in $KERNELS; do
           PAGEDCORE_CUDA_PAGED_FP8_DECODE=$k run ncu_$k 150 ncu --clock-control none --kernel-name regex:decode --launch-count 3 $NCU_SECTIONS \
             python3 backends/cuda_paged/bench/decode_probe.py --kv fp8,auto --iters 2
         done ;;
    probe) for shape in 64x4096 8x32768 256x1024; do for k in $KERNELS; do
             PAGEDCORE_CUDA_PAGED_FP8_DECODE=$k run probe_${k}_$shape 90 python3 backends/cuda_paged/bench/decode_probe.py --shape $shape --kv fp8,auto,fp8_e5m2 --json "$R/probe_${k}_$shape.json"
           done; done ;;
    conf) for k in $KERNELS; do
            PAGEDCORE_CUDA_PAGED_FP8_DECODE=$k run conf_$k 150 python3 -m pagedcore.cli conformance cuda_paged --device cuda --json "$R/conformance_$k.json"
          done ;;
    grid) for k in $KERNELS; do
            PAGEDCORE_CUDA_PAGED_FP8_DECODE=$k run grid_$k 120 python3 gpu/fp8_grid.py "$R/fp8_grid_$k.json"
          done ;;
    bench) for k in rows $KERNELS; do for kv in auto fp8; do
             PAGEDCORE_CUDA_PAGED_FP8_DECODE=$k run bench_${k}_$kv 60 python3 -m pagedcore.cli bench kernels --backend cuda_paged --case decode --kv-cache-dtype $kv --json "$R/bench_decode_${k}_$kv.json"
           done; done ;;
    memcheck) PAGEDCORE_CUDA_PAGED_FP8_DECODE=${KERNELS%% *} run memcheck 120 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pagedcore.cli \
                conformance cuda_paged --device cuda -k fp8 ;;
    # The Qwen2-0.5B attention shape (14 query / 2 KV heads, head size 64: GQA 7, which the
    # keys kernel serves too), fp8 and bf16; 256x560 is the engine's 0.5B decode step of issue
    # 22 (`pagedcore bench step`). Triton at this shape: `qwenbench`.
    probeqwen) for shape in 64x4096 256x1024 256x560; do for k in $KERNELS; do
             PAGEDCORE_CUDA_PAGED_FP8_DECODE=$k run probeqwen_${k}_$shape 90 python3 backends/cuda_paged/bench/decode_probe.py --shape $shape --heads 14/2 --head-size 64 --kv fp8,auto --json "$R/probeqwen_${k}_$shape.json"
           done; done ;;
    # The same shape through `pagedcore bench kernels` (its timing: behind a GPU spin, L2
    # flushed; +cudagraph rows = the engine's captured plan), triton and cuda_paged side by side.
    qwenbench) for kv in auto fp8; do
             run qwenbench_$kv 240 python3 -m pagedcore.cli bench kernels --backend triton --backend cuda_paged --case decode \
               --heads 14/2 --head-size 64 --decode-shapes 256x560,64x4096,256x1024 --kv-cache-dtype $kv --json "$R/qwenbench_$kv.json"
           done ;;
    qwensweep) run qwensweep 400 python3 gpu/qwen_decode_sweep.py "$R/qwen_decode_sweep.json" ;;
    pick) best=$(python3 - "$R" <<'PY'
import glob, json, sys
tot = {}
for f in glob.glob(f"{sys.argv[1]}/probe_*.json"):
    rows = json.load(open(f))["rows"]
    for r in rows:
        if r["kv_cache_dtype"] == "fp8" and r["fp8_kernel"] != "rows":
            tot.setdefault(r["fp8_kernel"], []).append(r["ms"])
print(min((sum(v), k) for k, v in tot.items() if len(v) == 3)[1])
PY
)
          echo "picked $best" | tee -a "$R/steps.txt"; KERNELS="$best" ;;
    ttests) run tests_triton_graphs 200 python3 -m pytest -q backends/triton/tests/test_cudagraph.py backends/triton/tests/test_mixed_capture.py ;;
    # Decode tiles at head size 64 (bf16 and fp8) on the three Qwen shapes, and a check at the
    # 32/8/128 default heads; then the 0.5B engine step at the default vs the 2-warp tile.
    tilesweep) for shape in 256x560 64x4096 256x1024; do
             run tilesweep_$shape 240 python3 gpu/qwen_decode_sweep.py "$R/tilesweep_$shape.json" --shape $shape \
               --tiles ";64,2,3;64,2,4;32,2,3;64,1,3;128,2,3;32,1,3;128,4,3" --rules uniform,balanced \
               --fp8-tiles ";128,2,5;64,2,5;128,2,4;64,4,5;256,4,5;64,4,3;128,2,3"
           done
           for shape in 64x4096 256x1024; do
             run tilesweep128_$shape 200 python3 gpu/qwen_decode_sweep.py "$R/tilesweep128_$shape.json" --shape $shape \
               --heads 32/8 --head-size 128 --layers 3 --tiles ";64,2,3;64,2,4;32,2,3" --rules uniform --fp8-tiles ";128,2,5;64,2,5"
           done ;;
    stepqwen) for t in default 64,2,3; do
             if [ $t = default ]; then unset PAGEDCORE_TRITON_DECODE_TILES; else export PAGEDCORE_TRITON_DECODE_TILES=$t; fi
             run stepqwen_$t 200 python3 -m pagedcore.cli bench step --model-shape qwen2-0.5b --batch-sizes 64,256 --no-eager --profile --json "$R/stepqwen_$t.json"
           done; unset PAGEDCORE_TRITON_DECODE_TILES ;;
    # Session 27: the small-head decode tiles (SMALL_HEAD_DECODE_TILES) in the bench, the
    # engine step with the server's delta outputs, triton conformance on the GPU.
    qwentri) for kv in auto fp8; do
             run qwentri_$kv 200 python3 -m pagedcore.cli bench kernels --backend triton --case decode \
               --heads 14/2 --head-size 64 --decode-shapes 256x560,64x4096,256x1024 --kv-cache-dtype $kv --json "$R/qwentri_$kv.json"
           done ;;
    stepdeltas) run stepdeltas 300 python3 -m pagedcore.cli bench step --model-shape qwen2-0.5b --batch-sizes 64,256 --steps 50 \
               --outputs all,deltas --no-eager --json "$R/stepdeltas.json" ;;
    fusedcheck) run fused_check ${FUSED_CHECK_LIMIT:-200} python3 docs/benchmarks/fused_check.py "$R/fused_check.json" --quick ;;
    # The 0.5B step: default fused kinds against all of them (down_add too).
    stepdownadd) for f in default 1; do
             if [ $f = default ]; then unset PAGEDCORE_FUSED_KERNELS; else export PAGEDCORE_FUSED_KERNELS=$f; fi
             run stepdownadd_$f 300 python3 -m pagedcore.cli bench step --model-shape qwen2-0.5b --batch-sizes 64,256 --steps 50 \
               --outputs all,deltas --no-eager --profile --json "$R/stepdownadd_$f.json"
           done; unset PAGEDCORE_FUSED_KERNELS ;;
    # The short form (little device time): batch 256, the server's delta outputs, no profile.
    stepdownadd256) for f in default 1; do
             if [ $f = default ]; then unset PAGEDCORE_FUSED_KERNELS; else export PAGEDCORE_FUSED_KERNELS=$f; fi
             run stepdownadd256_$f 90 python3 -m pagedcore.cli bench step --model-shape qwen2-0.5b --batch-sizes 256 --steps 30 \
               --outputs deltas --no-eager --json "$R/stepdownadd256_$f.json"
           done; unset PAGEDCORE_FUSED_KERNELS ;;
    conftri) run conf_triton 240 python3 -m pagedcore.cli conformance triton --device cuda --json "$R/conformance_triton.json" ;;
    confgraph) run confgraph_triton 200 python3 -m pagedcore.cli conformance triton -k graph/ ;;
    # Session 28: the conformance cases added after a mutation pass (steps3, late_scales,
    # saturating, long_prefill, very_long, wide, h16kv8, bs32/bs64, shared_* with sinks / fp8)
    # on every GPU backend, full suite (new cases only, by name, to save device time).
    confnew) run confnew 400 python3 gpu/conformance_new_cases.py "$R/conformance_new_cases.json" ;;
    *) echo "unknown step $s" ;;
  esac
  tar czf /tmp/fp8_keysm_round.tgz -C "$R" . && mv /tmp/fp8_keysm_round.tgz "$OUT/round.tgz"
done
tar czf /tmp/fp8_keysm_round.tgz -C "$R" . && mv /tmp/fp8_keysm_round.tgz "$OUT/round.tgz"
exit 0
