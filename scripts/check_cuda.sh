#!/usr/bin/env bash
# Compile-checks every CUDA kernel body (csrc/kernels/**/*_kernel.cuh) with nvcc alone: no CUDA
# torch needed. Each header is included by a generated .cu that instantiates its kernels.
set -euo pipefail
cd "$(dirname "$0")/.."
nvcc=${NVCC:-nvcc}
command -v "$nvcc" >/dev/null || { echo "check-cuda: nvcc not found" >&2; exit 1; }
arch=${CUDA_ARCH:-sm_90}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
status=0
for header in $(find csrc/kernels -name '*_kernel.cuh' | sort); do
  name=$(basename "$header" .cuh)
  instantiations="scripts/cuda_instantiations/$name.cu.inc"
  {
    echo "#include \"$PWD/$header\""
    [ -f "$instantiations" ] && cat "$instantiations"
  } > "$work/$name.cu"
  if "$nvcc" -std=c++17 -arch="$arch" -I"$PWD/csrc" -c "$work/$name.cu" -o "$work/$name.o"; then
    echo "check-cuda: $header ok"
  else
    echo "check-cuda: $header FAILED" >&2
    status=1
  fi
done
exit $status
