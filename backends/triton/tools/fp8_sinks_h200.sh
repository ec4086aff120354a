#!/usr/bin/env bash
# The fp8 KV-cache / attention-sink check on one GPU (docs/benchmarks/fp8_h200.json):
# triton conformance (full suite: fp8 and sink cases included), then decode timings of
# bf16, fp8 (e4m3) and bf16 + sinks. Usage: fp8_sinks_h200.sh OUTDIR
set -u
out=${1:?usage: fp8_sinks_h200.sh OUTDIR}
mkdir -p "$out"
timeout 150 python3 -m pagedcore.cli conformance triton --device cuda --json "$out/conformance.json" \
    > "$out/conformance.txt" 2>&1; echo "conformance rc=$?"
tail -5 "$out/conformance.txt"
for variant in auto fp8 sinks; do
    flags=()
    case $variant in fp8) flags=(--kv-cache-dtype fp8) ;; sinks) flags=(--sinks) ;; esac
    timeout 100 python3 -m pagedcore.cli bench kernels --backend triton --case decode \
        "${flags[@]}" --json "$out/kernels_$variant.json" > "$out/kernels_$variant.txt" 2>&1
    echo "bench $variant rc=$?"
done
