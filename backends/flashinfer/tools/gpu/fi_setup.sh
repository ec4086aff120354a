# Sourced by the round scripts: FlashInfer importable (the runner's install, or ours from its
# wheels in $ROOT_WHL) and its prebuilt modules (a tar of aot/<module>/<module>.so made by
# `prebuild_jit.py --pack`, carried as the job's extra file fi_aot.tar.xz) unpacked into its AOT
# directory, so that no module is JIT-built on the GPU machine. Sets AOT_DIR and FI_PREFILL
# (auto when the bf16/hs64 FA3 module came prebuilt, else fa2). Needs OUT and mark().
# FlashInfer: the runner's install, or ours from its wheels.
fi_info() {
  python3 -c "import flashinfer, flashinfer.jit.env as e; print(e.FLASHINFER_AOT_DIR, flashinfer.__version__)" 2> "$OUT/fi_import.txt"
}
FI_INFO=$(fi_info)
if [[ -z "$FI_INFO" && -d "${ROOT_WHL:-/nonexistent}" ]]; then
  bash backends/flashinfer/tools/install_offline.sh install "$ROOT_WHL" /tmp/fi_target \
    > /tmp/fi_env_fi.sh 2> "$OUT/fi_install.txt"
  . /tmp/fi_env_fi.sh
  FI_INFO=$(fi_info)
fi
AOT_DIR=${FI_INFO% *}
AOT_TAR=""
for cand in "$(dirname "${ROOT_WHL:-/x/.whl}")/.gpu/fi/extra/fi_aot.tar.xz" ./.gpu-extra/fi_aot.tar.xz; do
  [[ -f "$cand" ]] && AOT_TAR=$cand && break
done
if [[ -n "$AOT_TAR" && -n "$AOT_DIR" ]]; then
  mkdir -p "$AOT_DIR" && tar -xJf "$AOT_TAR" -C "$(dirname "$AOT_DIR")"
  ls "$AOT_DIR" > "$OUT/aot_modules.txt"
fi
mark "flashinfer ${FI_INFO#* }; aot tar '${AOT_TAR}' -> '${AOT_DIR}' ($(ls "$AOT_DIR" 2> /dev/null | wc -l) modules)"
# FlashInfer's default prefill kernels (auto: FA3 on sm90) when its bf16/hs64 FA3 module came
# prebuilt, else FA2 (never a JIT build inside this slot).
if grep -q "head_dim_qk_64_.*_sm90" "$OUT/aot_modules.txt" 2> /dev/null; then
  FI_PREFILL=auto
else
  FI_PREFILL=fa2
fi
