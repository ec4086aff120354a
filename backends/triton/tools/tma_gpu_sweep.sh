#!/bin/bash
# Hopper prefill kernel tile sweep on the H200 (issue 26; a 90 s cap):
#   OUT_DIR=... GPU_DEADLINE=... bash backends/triton/tools/tma_gpu_sweep.sh
# 1. one process per variant, in parallel: compile it at the timing shapes, then check it on
#    a NaN-poisoned ragged batch (prefixes, decodes, padding) against float64 -> check_<i>.json
# 2. alone on the GPU: 4x2048 / 4x8192 causal prefill of every variant beside SDPA
#    (tools/tma_variants.py --steps time) -> time.json
# 3. the full triton conformance suite in 16 shards on the best variant of step 2
#    (PAGEDCORE_TRITON_TMA_TILES) -> conformance_<i>.json, merged by conformance_shards.py
# Run from the repository root. VARIANTS overrides the list below; a CPU logic check:
#   SMALL=--small CONF_DEVICE=cpu TRITON_INTERPRET=1 PAGEDCORE_TRITON_PREFILL_KERNEL=tma VARIANTS=...
set -u
OUT=${OUT_DIR:?OUT_DIR}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
DEADLINE=${GPU_DEADLINE:-$(( $(date +%s) + 88 ))}
left() { echo $(( DEADLINE - $(date +%s) )); }
L0=$(left)  # the budget: ~42% compiles + checks, ~30% timing, the rest conformance
cap() { local l; l=$(( $(left) - $2 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
t0=$(date +%s)
T=backends/triton/tools
VARIANTS=${VARIANTS:-"default 128,128,4,2,wsk 128,64,4,3,wsk 128,128,4,2,wsk,hm 128,64,8,2,r128 64,64,4,3 128,32,8,3 128,64,4,4,wsk 128,64,4,2,wsk 128,64,4,3,wsk,hm 128,32,8,4 128,128,8,3,e1,hm"}
echo "variants: $VARIANTS" | tee "$OUT/log.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >> "$OUT/log.txt" 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/log.txt" 2>&1
i=0
W=$(( L0 * 42 / 100 ))
for v in $VARIANTS; do
  timeout -k 2 "$W" python3 $T/tma_variants.py --warm "$v" "$OUT/check_$i.json" ${SMALL:-} > "$OUT/warm_$i.log" 2>&1 &
  i=$((i + 1))
done
timeout -k 2 "$W" python3 $T/tma_variants.py --warm gather ${SMALL:-} > "$OUT/warm_gather.log" 2>&1 &
wait
echo "== warm + checks done at +$(( $(date +%s) - t0 ))s" | tee -a "$OUT/log.txt"
grep -h "warm\|Error" "$OUT"/warm_*.log | tail -30 | tee -a "$OUT/log.txt"
python3 - "$OUT" <<'PY' | tee -a "$OUT/log.txt"
import json, sys, pathlib
for f in sorted(pathlib.Path(sys.argv[1]).glob("check_*.json")):
    for r in json.loads(f.read_text())["rows"]:
        print("check", f.name, r.get("variant"), "fresh" if r.get("fresh") else "ragged", r.get("rel_err"), r.get("ok"), r.get("tma_ran"), r.get("error", "")[:200])
PY
B=$(cap $(( L0 * 30 / 100 )) 12)
[ "$B" -lt 5 ] && B=5
timeout -k 2 "$B" python3 $T/tma_variants.py "$OUT" --steps time --budget $((B - 4)) ${SMALL:-} $VARIANTS > "$OUT/time.log" 2>&1
echo "== time done at +$(( $(date +%s) - t0 ))s" | tee -a "$OUT/log.txt"
BEST=$(python3 $T/tma_variants.py --best "$OUT")
echo "best: $BEST" | tee -a "$OUT/log.txt"
python3 - "$OUT" <<'PY' | tee -a "$OUT/log.txt"
import json, sys, pathlib
p = pathlib.Path(sys.argv[1]) / "time.json"
rows = json.loads(p.read_text())["rows"] if p.exists() else []
for r in rows:
    if "ms" in r:
        print(f"{r['shape']:8} {r.get('variant', r['impl']):28} {r['ms']:.4f} ms {r['TFLOPs']:6.1f} TF "
              f"vs_sdpa {r.get('vs_sdpa_last', 1):.3f} err {r.get('rel_err_vs_sdpa', 0):.2g}")
    else:
        print(r)
PY
C=$(cap 40 4)
[ "$C" -lt 3 ] && exit 0
if [ "$BEST" != default ]; then export PAGEDCORE_TRITON_TMA_TILES="$BEST"; fi
for s in $(seq 0 15); do
  timeout -k 1 "$C" python3 $T/conformance_shards.py "$OUT" 16 "$s" triton --device ${CONF_DEVICE:-cuda} > "$OUT/shard_$s.log" 2>&1 &
done
wait
echo "== conformance ($BEST) done at +$(( $(date +%s) - t0 ))s" | tee -a "$OUT/log.txt"
python3 $T/conformance_shards.py "$OUT" merge triton --device ${CONF_DEVICE:-cuda} 2>&1 | tail -3 | tee -a "$OUT/log.txt"
