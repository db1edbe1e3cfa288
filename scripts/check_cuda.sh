#!/usr/bin/env bash
# Compile-checks the CUDA code with nvcc alone, no GPU and no CUDA torch needed:
#  - that no kernel body (csrc/kernels/**/*_kernel.cuh) includes a torch header, and every body
#    without a launcher, included by a generated .cu that instantiates its kernels
#    (scripts/cuda_instantiations/), compiled without torch (a launcher compiles its body);
#  - every launcher (csrc/kernels/**/*_cuda.cu) against the installed torch's headers, with
#    scripts/cuda_stubs standing in for the generated c10/cuda header a CPU-only torch lacks;
#  - the CUDA half of host code that has one (engine/cuda_graph_runner.cpp), the same way.
set -euo pipefail
cd "$(dirname "$0")/.."
nvcc=${NVCC:-nvcc}
command -v "$nvcc" >/dev/null || { echo "check-cuda: nvcc not found" >&2; exit 1; }
arch=${CUDA_ARCH:-sm_90}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
status=0
check_body() {
  name=$(basename "$1" .cuh)
  instantiations="scripts/cuda_instantiations/$name.cu.inc"
  {
    echo "#include \"$PWD/$1\""
    [ -f "$instantiations" ] && cat "$instantiations"
  } > "$work/$name.cu"
  if "$nvcc" -std=c++17 -arch="$arch" -I"$PWD/csrc" -c "$work/$name.cu" -o "$work/$name.o"; then
    echo "check-cuda: $1 ok"
  else
    echo "check-cuda: $1 FAILED" >&2
    return 1
  fi
}
export -f check_body
export nvcc arch work
# Each file is one nvcc process: $JOBS at a time, the machine's cores by default.
if grep -lE '#include [<"](torch|ATen|c10)/' $(find csrc/kernels -name '*_kernel.cuh'); then
  echo "check-cuda: the kernel bodies above include torch headers" >&2
  status=1
fi
for body in $(find csrc/kernels -name '*_kernel.cuh' | sort); do
  [ -f "${body%_kernel.cuh}_cuda.cu" ] || echo "$body"
done | xargs -r -P "${JOBS:-$(nproc)}" -I{} bash -c 'check_body "$1"' _ {} || status=1

python=${PYTHON:-python3}
torch_dir=$("$python" -c "import os, torch; print(os.path.dirname(torch.__file__))")
includes=(-I"$PWD/csrc" -I"$torch_dir/include" -I"$torch_dir/include/torch/csrc/api/include")
generated="$torch_dir/include/c10/cuda/impl/cuda_cmake_macros.h"
[ -f "$generated" ] || includes+=(-I"$PWD/scripts/cuda_stubs")
# The launchers in one nvcc process per core, each compiling a group of them as one translation
# unit: torch's headers, most of a launcher's compile time, are parsed once per group. File-local
# names must therefore differ between launchers; when a group fails, its launchers are compiled
# one by one to tell a name clash from an error of one file.
compile_launchers() {
  local group=$1 source
  shift
  for source in "$@"; do echo "#include \"$PWD/$source\""; done > "$work/$group.cu"
  "$nvcc" -std=c++20 -arch="$arch" --expt-relaxed-constexpr -diag-suppress 20013,20015 \
    "${includes[@]}" -c "$work/$group.cu" -o "$work/$group.o"
}
check_group() {
  local group=$1 source status=0
  shift
  if compile_launchers "$group" "$@" 2> "$work/$group.log"; then
    printf 'check-cuda: %s ok\n' "$@"
    return 0
  fi
  for source in "$@"; do
    if compile_launchers "$group-$(basename "$source" .cu)" "$source" 2> "$work/$group-one.log"; then
      echo "check-cuda: $source ok"
    else
      cat "$work/$group-one.log" >&2
      echo "check-cuda: $source FAILED" >&2
      status=1
    fi
  done
  if [ $status = 0 ]; then
    cat "$work/$group.log" >&2
    echo "check-cuda: $* compile alone but not together: rename the clashing names above" >&2
  fi
  return 1
}
export -f compile_launchers check_group
export includes_line="${includes[*]}"
# paged_attention's launcher compiles its many tensor-core variants for about two minutes, as long
# as the other launchers together: it gets a process of its own, the rest share the others.
heavy=(csrc/kernels/attention/paged_attention_cuda.cu)
groups=${JOBS:-$(nproc)}
rest=()
for source in $(find csrc/kernels -name '*_cuda.cu' | sort); do
  [[ " ${heavy[*]} " == *" $source "* ]] || rest+=("$source")
done
{
  if [ "$groups" -gt 1 ]; then
    echo "launchers_heavy ${heavy[*]}"
    groups=$((groups - 1))
  else
    rest+=("${heavy[@]}")
  fi
  for ((g = 0; g < groups; g++)); do
    members=()
    for ((i = g; i < ${#rest[@]}; i += groups)); do members+=("${rest[i]}"); done
    [ ${#members[@]} -gt 0 ] && echo "launchers$g ${members[*]}"
  done
} | xargs -P "${JOBS:-$(nproc)}" -L 1 bash -c 'includes=($includes_line); check_group "$@"' _ ||
  status=1

# Host code with a CUDA half (KVSERVE_WITH_CUDA=1 in a CUDA build): the CUDA-graph runner.
for source in csrc/engine/cuda_graph_runner.cpp; do
  if "$nvcc" -std=c++20 -DKVSERVE_WITH_CUDA=1 "${includes[@]}" -Icsrc/include -c "$source" \
      -o "$work/$(basename "$source" .cpp).o" 2> "$work/host.log"; then
    echo "check-cuda: $source ok"
  else
    cat "$work/host.log" >&2
    echo "check-cuda: $source FAILED" >&2
    status=1
  fi
done
exit $status
