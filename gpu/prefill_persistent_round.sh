#!/usr/bin/env bash
# The persistent warp-specialized prefill round (issue 26, session 24): the shipped Hopper
# prefill default (`128,128,4,2,wsk,hm`) against its persistent form (`wsk,p`, see
# pagedcore_triton.plan_tma.TMA_TILE_FLAGS; the other forms of session 24's rounds, `po`, `pn`,
# `pf`, `pfn` and the `ts` store, measured slower on an H100 and were removed afterwards), in
# one call from the repository root:
#   PAGEDCORE_GIT_COMMIT=<sha> bash gpu/prefill_persistent_round.sh
# 1. install: register the plugins (a fresh device machine has none);
# 2. probes, in parallel, one process each: compile, then the NaN-poisoned checks of
#    tools/tma_variants.py (ragged batch with cached prefixes, then prefix-free) -> check_<i>.json;
# 3. alone on the GPU: causal 4x2048 / 4x8192 of the default and of every probe that passed,
#    torch SDPA re-timed every two variants -> time.json; the best -> BEST.txt (the default
#    unless a variant beats it by more than 2%);
# 4. with BEST's tiles: the full triton conformance suite in 16 shards
#    (conformance_triton_summary.json), then `pagedcore bench kernels --backend triton --case
#    prefill --case mixed` -> kernels_triton.json (both only when BEST is not the default).
# Everything lands under $OUT/r and is packed into $OUT/round.tgz (the device tool brings
# back only a few files per call).
set -u
OUT=${OUT:-/tmp/prefill_persistent_round}
R=$OUT/r
mkdir -p "$R"
export PYTHONUNBUFFERED=1
T=backends/triton/tools
t0=$(date +%s)
stamp() { echo "== $1 at +$(( $(date +%s) - t0 ))s" | tee -a "$R/log.txt"; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader > "$R/device.txt" 2>&1
echo "commit ${PAGEDCORE_GIT_COMMIT:-unknown}" >> "$R/device.txt"
timeout 120 python3 -m pip install --no-deps --no-build-isolation -e . -e backends/triton \
  > "$R/install.log" 2>&1
stamp "install rc=$?"
PROBES=${PROBES:-"default 128,128,4,2,wsk,p"}
i=0
for v in $PROBES; do
  timeout -k 2 "${PROBE_CAP:-120}" python3 $T/tma_variants.py --warm "$v" "$R/check_$i.json" \
    ${SMALL:-} > "$R/warm_$i.log" 2>&1 &
  i=$((i + 1))
done
wait
stamp "probes done"
OK=$(python3 - "$R" <<'PY'
import json, pathlib, sys
ok = []
for f in sorted(pathlib.Path(sys.argv[1]).glob("check_*.json")):
    rows = json.loads(f.read_text())["rows"]
    for r in rows:
        print("check", r.get("variant"), "fresh" if r.get("fresh") else "ragged",
              r.get("rel_err"), r.get("ok"), r.get("tma_ran"), r.get("error", "")[:300],
              file=sys.stderr)
    if len(rows) == 2 and all(r.get("ok") for r in rows) and rows[0]["variant"] != "default":
        ok.append(rows[0]["variant"])
print(" ".join(ok))
PY
)
grep -h "^warm\|Error" "$R"/warm_*.log | cut -c1-300 | tee -a "$R/log.txt"
echo "probes passed: ${OK:-none}" | tee -a "$R/log.txt"
TMA_NO_GATHER=1 timeout -k 2 "${TIME_CAP:-150}" python3 $T/tma_variants.py "$R" --steps time \
  --budget "${TIME_BUDGET:-120}" ${SMALL:-} default $OK > "$R/time.log" 2>&1
BEST=$(python3 $T/tma_variants.py --best "$R")
echo "$BEST" > "$R/BEST.txt"
stamp "time done, best $BEST"
python3 - "$R" <<'PY' | tee -a "$R/log.txt"
import json, pathlib, sys
p = pathlib.Path(sys.argv[1]) / "time.json"
for r in json.loads(p.read_text())["rows"] if p.exists() else []:
    if "ms" in r:
        print(f"{r['shape']:8} {r.get('variant', r['impl']):22} {r['ms']:.4f} ms "
              f"{r['TFLOPs']:6.1f} TF vs_sdpa {r.get('vs_sdpa_last', 1):.3f} "
              f"err {r.get('rel_err_vs_sdpa', 0):.2g}")
    elif "error" in r or "skipped" in r:
        print(r)
PY
if [ "$BEST" != default ] || [ -n "${FORCE_CONF:-}" ]; then
  [ "$BEST" != default ] && export PAGEDCORE_TRITON_TMA_TILES="$BEST"
  for s in $(seq 0 15); do
    timeout -k 2 "${CONF_CAP:-170}" python3 $T/conformance_shards.py "$R" 16 "$s" triton \
      --device ${CONF_DEVICE:-cuda} > "$R/shard_$s.log" 2>&1 &
  done
  wait
  python3 $T/conformance_shards.py "$R" merge triton --device ${CONF_DEVICE:-cuda} 2>&1 \
    | tail -1 | cut -c1-600 | tee -a "$R/log.txt"
  stamp "conformance (${PAGEDCORE_TRITON_TMA_TILES:-default}) done"
  timeout -k 2 "${BENCH_CAP:-120}" python3 -m pagedcore.cli bench kernels --backend triton \
    --case prefill --case mixed ${BENCH_QUICK:-} --json "$R/kernels_triton.json" \
    > "$R/bench.log" 2>&1
  tail -8 "$R/bench.log" | cut -c1-200 | tee -a "$R/log.txt"
  stamp "bench done (tiles ${PAGEDCORE_TRITON_TMA_TILES:-default})"
fi
stamp "end"
tar czf "$OUT/round.tgz" -C "$R" .
cp "$R/log.txt" "$OUT/log.txt"
