#!/usr/bin/env bash
# Tuning sweep: fp8 decode tile length (PAGEDCORE_TRITON_DECODE_TILE_N). Usage: OUTDIR
out=${1:?usage: fp8_decode_tiles.sh OUTDIR}
mkdir -p "$out"
for n in 64 128 256; do
    PAGEDCORE_TRITON_DECODE_TILE_N=$n timeout 30 python3 -m pagedcore.cli bench kernels \
        --backend triton --case decode --kv-cache-dtype fp8 --json "$out/fp8_tile$n.json" \
        > "$out/fp8_tile$n.txt" 2>&1
    echo "tile $n rc=$?"
done
