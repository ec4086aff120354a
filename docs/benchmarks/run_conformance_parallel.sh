#!/bin/bash
# Full conformance of a backend on the GPU, one process per case, 8 in parallel
# (Triton's on-disk cache is shared; cases compile their own variants in parallel).
# Usage: bash docs/benchmarks/run_conformance_parallel.sh RESULT_DIR [BACKEND]   (default triton)
# Used for the session-3 H200 runs (h200_s3_final/conformance_triton_h200_summary.json). Writes
# RESULT_DIR/conformance_<backend>_gpu_summary.json and one report per case under RESULT_DIR/conf/.
R=$1; B=${2:-triton}; mkdir -p $R/conf
python3 -m pagedcore.cli conformance "$B" --list --device cuda > $R/cases.txt 2>&1
grep -v "skipped" $R/cases.txt | grep "/" > $R/run_cases.txt
echo "cases: $(wc -l < $R/run_cases.txt) (listed $(wc -l < $R/cases.txt))"
i=0
while read -r c; do i=$((i+1)); echo "$i $c"; done < $R/run_cases.txt > $R/indexed.txt
# -k is a substring filter; several case names are prefixes of others, so each job checks its report has the exact case.
cat $R/indexed.txt | xargs -P 8 -L 1 bash -c 'timeout 240 python3 -m pagedcore.cli conformance '$B' --device cuda -k "$1" --json '$R'/conf/$0.json > '$R'/conf/$0.txt 2>&1; echo "case $0 rc=$?"'
python3 - "$R" "$B" <<'PY'
import json, sys, pathlib
r = pathlib.Path(sys.argv[1])
want = [l.split(" ", 1)[1].strip() for l in (r / "indexed.txt").read_text().splitlines()]
seen = {}
for f in sorted((r / "conf").glob("*.json")):
    d = json.loads(f.read_text())
    for c in d.get("cases", d.get("results", [])):
        name = c.get("name") or c.get("case")
        seen.setdefault(name, c)
ok = [n for n in want if n in seen and (seen[n].get("passed") or seen[n].get("status") == "passed")]
bad = [n for n in want if n not in ok]
summary = {"backend": sys.argv[2], "device": "cuda", "cases": len(want), "passed": len(ok), "not_passed": bad}
(r / f"conformance_{sys.argv[2]}_gpu_summary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary, indent=1))
PY
