#!/usr/bin/env bash
# The fp8 KV-cache / attention-sink check on one GPU (docs/benchmarks/fp8_h200.json):
# triton conformance (quick, with its fp8 and sink cases, and the full suite's long batch with
# fp8 and sinks through the split-KV decode), then decode timings of
# bf16, fp8 (e4m3) and bf16 + sinks. Usage: fp8_sinks_h200.sh OUTDIR
set -u
out=${1:?usage: fp8_sinks_h200.sh OUTDIR}
mkdir -p "$out"
timeout 90 python3 -m pagedcore.cli conformance triton --device cuda --quick \
    --json "$out/conformance_quick.json" > "$out/conformance_quick.txt" 2>&1
echo "conformance quick rc=$?"; tail -3 "$out/conformance_quick.txt"
timeout 60 python3 -m pagedcore.cli conformance triton --device cuda -k long/ \
    --json "$out/conformance_long.json" > "$out/conformance_long.txt" 2>&1
echo "conformance long rc=$?"; tail -8 "$out/conformance_long.txt"
for variant in auto fp8 sinks; do
    flags=()
    case $variant in fp8) flags=(--kv-cache-dtype fp8) ;; sinks) flags=(--sinks) ;; esac
    timeout 50 python3 -m pagedcore.cli bench kernels --backend triton --case decode \
        "${flags[@]}" --json "$out/kernels_$variant.json" > "$out/kernels_$variant.txt" 2>&1
    echo "bench $variant rc=$?"
done
