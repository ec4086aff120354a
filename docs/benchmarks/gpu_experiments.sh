#!/usr/bin/env bash
# The four experiments of docs/benchmarks.md on a GPU, one after another.
#
#   pip install --no-build-isolation --no-deps -e . -e backends/triton   # + any other backend
#   bash docs/benchmarks/gpu_experiments.sh [NAME ...]    # NAME: backends memory prefix chunked
#
# Results: ${OUT:-docs/benchmarks}/{backends_h200_live,memory_h200,prefix_h200,chunked_h200}
# .json/.png. A failing experiment does not stop the others; the exit status is 1 if any failed.
# Expected wall time on one H200: a few minutes each (chunked is the longest: 9 engine
# configurations x 3 repetitions of a 32K-token prompt + 20 short requests).
set -u
cd "$(dirname "$0")/../.."
D="${OUT:-docs/benchmarks}"
mkdir -p "$D"
WANT="${*:-backends memory prefix chunked}"
rc=0
for name in $WANT; do
  case "$name" in
    backends) stem=backends_h200_live ;;
    memory|prefix|chunked) stem=${name}_h200 ;;
    *) echo "unknown experiment '$name' (choose: backends memory prefix chunked)" >&2; exit 2 ;;
  esac
  echo "== pagedcore bench $name --json $D/$stem.json --plot $D/$stem.png"
  if ! pagedcore bench "$name" --json "$D/$stem.json" --plot "$D/$stem.png"; then
    echo "FAILED: pagedcore bench $name" >&2
    rc=1
  fi
done
exit $rc
