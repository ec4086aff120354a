#!/usr/bin/env bash
# The cascade overlap round (issue 26), prepared in session 23, run in session 24 on an H100
# (results: docs/benchmarks/h100_s24/README.md; the overlap did not pay and stays off):
# the overlap probe (the prefix launch on a side stream beside a split suffix launch, eager and
# graphed, against the shipped fused cascade), `bench kernels --case cascade` with and without
# the overlap, the GPU cascade tests and graph conformance at HEAD and with the overlap on, and
# the mixed-cascade steps timed on CUDA events (incl. a short prefix under long chunks). Steps
# run in the order given, each with its own time limit, so whatever ran comes back under $OUT.
# On a fresh device machine `install` must come first (it registers the plugins). Repo root:
#   PAGEDCORE_GIT_COMMIT=<sha> bash gpu/cascade_overlap_round.sh [steps...]
# e.g. one 600 s call: install probe benchov bench tests conf confov testsov mixedshort mixed8b
set -uo pipefail
OUT=${OUT:-/tmp/cascade_overlap_round}
mkdir -p "$OUT"
steps=${*:-"install probe benchov bench tests conf confov testsov mixedshort mixed8b"}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader > "$OUT/device.txt" 2>&1 || true
LOG_DIR=$OUT TAIL_LINES=8
source "$(dirname "$0")/round_lib.sh"
for s in $steps; do
  case $s in
    install) run install 120 python3 -m pip install --no-deps --no-build-isolation -e . -e backends/triton ;;
    probe) run probe 200 python3 backends/triton/tools/cascade_probe.py --no-sweeps --json "$OUT/probe.json" ;;
    bench) run bench 150 python3 -m pagedcore.cli bench kernels --backend triton --case cascade --json "$OUT/kernels_cascade.json" ;;
    benchov) PAGEDCORE_TRITON_CASCADE_OVERLAP=1 run benchov 150 python3 -m pagedcore.cli bench kernels --backend triton --case cascade --json "$OUT/kernels_cascade_overlap.json" ;;
    tests) run tests 200 python3 -m pytest -q -x backends/triton/tests/test_cascade.py -k gpu ;;
    conf) run conf 200 python3 -m pagedcore.cli conformance triton -k graph/ ;;
    confshared) run confshared 200 python3 -m pagedcore.cli conformance triton -k shared_ ;;
    # The same with the prefix launch beside the suffix launch (PAGEDCORE_TRITON_CASCADE_OVERLAP).
    confov) PAGEDCORE_TRITON_CASCADE_OVERLAP=1 run confov 200 python3 -m pagedcore.cli conformance triton -k cascade
            PAGEDCORE_TRITON_CASCADE_OVERLAP=1 run confovshared 200 python3 -m pagedcore.cli conformance triton -k shared_ ;;
    testsov) PAGEDCORE_TRITON_CASCADE_OVERLAP=1 run testsov 200 python3 -m pytest -q -x backends/triton/tests/test_cascade.py -k gpu ;;
    mixed8b) run mixed8b 240 python3 gpu/cascade_mixed.py --reps 4 --json "$OUT/cascade_mixed_llama3-8b.json" ;;
    # The mixed cascade rule's risk: a short shared prefix under long prompt chunks (the split
    # suffix's partials, ~T x Hq x 2 x (D+2) x 4 B each way, rival the saved prefix reads).
    mixedshort) run mixedshort 240 python3 gpu/cascade_mixed.py --reps 3 --prefix 512 --own 240 --json "$OUT/cascade_mixed_llama3-8b_p512.json" ;;
    mixed05b) run mixed05b 180 python3 gpu/cascade_mixed.py --reps 4 --model-shape qwen2-0.5b --json "$OUT/cascade_mixed_qwen2-0.5b.json" ;;
    *) echo "unknown step $s" ;;
  esac
done
# The device tool brings back only a few files per call: everything also goes into one archive.
tar czf "/tmp/cascade_overlap_round.tgz" -C "$OUT" . && mv /tmp/cascade_overlap_round.tgz "$OUT/round.tgz"
exit 0
