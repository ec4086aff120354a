#!/usr/bin/env bash
# Bring flashinfer-python 0.7.2.post1 onto a machine without a package registry.
#
#   here (with pip access):   bash backends/flashinfer/tools/install_offline.sh download [WHL_DIR]
#   there (no registry):      eval "$(bash backends/flashinfer/tools/install_offline.sh install WHL_DIR TARGET)"
#
# `download` fetches the wheels FlashInfer's import and JIT build really need (measured on the
# H200, see README.md): flashinfer-python, apache-tvm-ffi, ninja, einops, nvidia-ml-py, tabulate,
# for CPython 3.12 / manylinux x86_64, then repacks the flashinfer wheel (62 MB) as the tar.xz of
# its unpacked contents (17.5 MB) so every file stays under a 64 MiB transfer limit.
# `install` unpacks that tar.xz into TARGET, pip-installs the other wheels there with
# --no-index --no-deps --target, and prints the exports to use (PYTHONPATH, PATH for ninja,
# FLASHINFER_CUDA_ARCH_LIST); progress goes to stderr so that `eval "$(...)"` works.
set -euo pipefail
PY=${PY:-python3}
FI_VERSION=0.7.2.post1
mode=${1:?usage: install_offline.sh download [WHL_DIR] | install WHL_DIR TARGET}

case "$mode" in
download)
  WHL=${2:-.whl}
  mkdir -p "$WHL"
  "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$WHL" \
    "flashinfer-python==$FI_VERSION" apache-tvm-ffi==0.1.15.post2 ninja==1.13.2 \
    einops nvidia-ml-py tabulate
  wheel=$(ls "$WHL"/flashinfer_python-"$FI_VERSION"-*.whl)
  tmp=$(mktemp -d)
  "$PY" -m zipfile -e "$wheel" "$tmp"
  tar -cJf "$WHL/flashinfer_python-$FI_VERSION.tar.xz" -C "$tmp" .
  rm -rf "$tmp" "$wheel"
  ls -l "$WHL"
  ;;
install)
  WHL=${2:?install needs WHL_DIR}
  TARGET=${3:?install needs TARGET}
  mkdir -p "$TARGET"
  tar -xJf "$WHL/flashinfer_python-$FI_VERSION.tar.xz" -C "$TARGET" >&2
  # Everything but flashinfer itself (already unpacked above).
  mapfile -t wheels < <(ls "$WHL"/*.whl)
  "$PY" -m pip install --no-index --no-deps --target "$TARGET" "${wheels[@]}" >&2
  TARGET=$(cd "$TARGET" && pwd)
  echo "export PYTHONPATH=$TARGET\${PYTHONPATH:+:\$PYTHONPATH}"
  echo "export PATH=$TARGET/bin:\$PATH"
  echo "export FLASHINFER_CUDA_ARCH_LIST=\${FLASHINFER_CUDA_ARCH_LIST:-9.0}"
  ;;
*)
  echo "unknown mode $mode; use download or install" >&2
  exit 2
  ;;
esac
