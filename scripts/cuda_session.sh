#!/usr/bin/env bash
# On a machine with an NVIDIA GPU and a CUDA build of torch (not CI): builds kvserve with its
# CUDA kernels, then runs the stages named on the command line, logging each under $OUT (or
# /tmp/kvserve-cuda):
#   test      the kernel tests on CUDA (every kernel test, rerun with ops on the GPU) and the
#             tests marked cuda (the engine on the GPU against transformers and the CPU engine)
#   test-attention, test-engine   only paged_attention's kernel tests / only the engine's
#   test-distributed   tensor parallelism with two ranks sharing the GPU over Gloo
#   errors    the bad-argument kernel tests alone, one process, with Python's fault handler; if
#             one crashes, its native backtrace (cuda-gdb, which debugs host code too)
#   sanitize  compute-sanitizer memcheck and racecheck over a subset of the CUDA kernel tests
#   bench-attention, bench-e2e, bench-quant   benchmarks/bench_cuda_attention.py,
#             benchmarks/bench_cuda_e2e.py, benchmarks/bench_cuda_quant.py
#   profile-attention   Nsight Compute over paged_attention's kernels (speed of light,
#             occupancy, warp stalls): prefill of 8,192 tokens (128- and 64-row tiles), decode of
#             1 x 160 and 64 x 8,192 (benchmarks/profile_cuda_attention.py); PROFILE_CASES
#             ("case args;case args") replaces them
#   profile-quant   the same over quantized_linear's tensor-core kernels (gate_up of Llama-3-8B,
#             int8 and int4 at 8 and 64 tokens; benchmarks/profile_cuda_quant.py);
#             PROFILE_QUANT_CASES replaces them ("--format int8 --tokens 64 --kernel wide")
#     bash scripts/cuda_session.sh test bench-attention
# DEADLINE=S: every stage ends within S seconds of the start (cut short, or skipped when under
# 20 s are left), so a lease's time limit still leaves the logs. TEST_TIMEOUT, BENCH_TIMEOUT:
# seconds per test / benchmark stage; PYTEST_ARGS (e.g. -n 8), ATTENTION_ARGS, E2E_ARGS,
# QUANT_ARGS, SANITIZE_TOOLS, SANITIZE_K pass through.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/kvserve-cuda}
mkdir -p "$out"
python=${PYTHON:-python3}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
start=$(date +%s)
# A warm machine keeps an earlier call's build folder, which may hold another configuration.
[ "${CLEAN:-1}" = 1 ] && rm -rf build/py
# One GPU architecture and one CPU kernel variant: the build is for this machine only.
if ! $python -m pip install -q --no-build-isolation --no-deps -e . \
    --config-settings=cmake.define.KVSERVE_CUDA=ON \
    --config-settings=cmake.define.CMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHITECTURES:-90}" \
    --config-settings=cmake.define.KVSERVE_CPU_CAPABILITIES=AVX2 \
    --config-settings=install.strip=false > "$out/build.log" 2>&1; then
  tail -60 "$out/build.log"
  echo "cuda_session: build FAILED after $(( $(date +%s) - start )) s"
  exit 1
fi
echo "cuda_session: built in $(( $(date +%s) - start )) s"
$python - <<'EOF' || { echo "cuda_session: the CUDA kernels are not registered"; exit 1; }
import kvserve, torch
ops = ["paged_attention", "rms_norm", "kv_cache_write", "sampling_from_logits", "fused_moe"]
missing = [op for op in ops
           if not torch._C._dispatch_has_kernel_for_dispatch_key(f"kvserve::{op}", "CUDA")]
assert kvserve._C.built_with_cuda() and not missing, f"no CUDA kernel for {missing}"
print("CUDA kernels registered")
EOF
# Seconds a stage may take: its own limit, or less where the deadline is nearer.
limit() {
  local own=$1
  [ "${DEADLINE:-0}" -gt 0 ] || { echo "$own"; return; }
  local left=$(( start + DEADLINE - $(date +%s) ))
  echo $(( left < own ? left : own ))
}
cuda_tests() {  # log name, then pytest arguments
  local name=$1 seconds
  shift
  seconds=$(limit "${TEST_TIMEOUT:-420}")
  [ "$seconds" -ge 20 ] || { echo "cuda_session: no time left for $name"; return 1; }
  # -v: a run cut short by its limit still names each test it finished. Few threads per
  # process: with pytest-xdist workers, the CPU references would oversubscribe the cores.
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} timeout "$seconds" $python -m pytest -v -rfE \
    -p no:cacheprovider -m cuda -o addopts="" "$@" ${PYTEST_ARGS:-} > "$out/$name.log" 2>&1
  local rc=$?
  echo "$name (exit $rc):"; grep -E "[0-9]+ (passed|failed)" "$out/$name.log" | tail -2
  grep -E "^(FAILED|ERROR)|(FAILED|ERROR) tests/" "$out/$name.log" | head -40
  return $rc
}
status=0
for stage in "$@"; do
  case $stage in
    test) cuda_tests test tests/kernels tests/e2e/test_cuda_engine.py || status=1 ;;
    test-attention)
      cuda_tests test-attention tests/kernels/test_paged_attention.py \
        tests/kernels/test_paged_attention_quantized_kv.py || status=1 ;;
    test-engine) cuda_tests test-engine tests/e2e/test_cuda_engine.py || status=1 ;;
    test-distributed)
      cuda_tests test-distributed tests/distributed/test_tensor_parallel_engine.py || status=1 ;;
    errors)
      args=(-q -p no:cacheprovider -p no:xdist -o addopts="" -k "reject or bad"
            tests/kernels)
      timeout "$(limit 60)" $python -X faulthandler -m pytest "${args[@]}" \
        > "$out/errors.log" 2>&1
      rc=$?
      echo "bad-argument tests: exit $rc"; tail -5 "$out/errors.log"
      lib=$($python -c "import kvserve, pathlib
print(pathlib.Path(kvserve._C.__file__).parent / 'libkvserve_runtime.so')")
      echo "libstdc++ stream code defined in $(basename "$lib"): $(nm -D --defined-only "$lib" \
        | grep -c -E "_ZNSo9_M_insert|_ZNKSt7codecvt") symbols (0 expected)"
      if [ $rc -ge 128 ] || grep -q "Fatal Python error" "$out/errors.log"; then
        grep -A30 "Fatal Python error" "$out/errors.log" | head -40
        # Where the crashing stream code comes from: libstdc++ symbols defined in our library,
        # the link line, the compilers and the flags the build saw.
        { echo "== libstdc++ symbols defined in $lib"; nm -C --defined-only "$lib" | grep -c "std::"
          nm -C --defined-only "$lib" | grep -E "basic_ostream|codecvt|locale::id" | head -20
          echo "== dynamic dependencies"; ldd "$lib"
          echo "== link line"; grep -h -A2 "libkvserve_runtime.so" build/py/build.ninja | head -8
          echo "== compilers"; c++ --version | head -1; nvcc --version | tail -1
          env | grep -E "FLAGS|^CC=|^CXX=|CUDAHOSTCXX" ; } > "$out/errors-link.log" 2>&1
        head -40 "$out/errors-link.log"
        timeout "$(limit 90)" cuda-gdb -q -batch -ex "set pagination off" -ex run -ex bt \
          --args $python -m pytest -x "${args[@]}" > "$out/errors-gdb.log" 2>&1
        grep -E "^#[0-9]+ " "$out/errors-gdb.log" | head -40
      fi ;;
    sanitize)
      for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
        timeout "$(limit 240)" compute-sanitizer --tool $tool --error-exitcode 9 \
          $python -m pytest -q -p no:cacheprovider -m cuda -o addopts="" -x \
          tests/kernels/test_paged_attention.py tests/kernels/test_kv_cache_write.py \
          tests/kernels/test_rms_norm.py tests/kernels/test_rotary_embedding.py \
          -k "${SANITIZE_K:-long_contexts or gqa_groups or latent or every_cuda_kernel or head_norms_sides}" \
          > "$out/sanitize-$tool.log" 2>&1
        echo "compute-sanitizer $tool: exit $?"; grep -E "ERROR SUMMARY|passed|failed" \
          "$out/sanitize-$tool.log" | tail -3
      done ;;
    bench-attention)
      timeout "$(limit ${BENCH_TIMEOUT:-600})" $python benchmarks/bench_cuda_attention.py \
        ${ATTENTION_ARGS:-} --out "$out/cuda_attention.json" \
        2>&1 | tee "$out/bench_attention.log" | tail -40 ;;
    bench-e2e)
      timeout "$(limit ${BENCH_TIMEOUT:-600})" $python benchmarks/bench_cuda_e2e.py ${E2E_ARGS:-} \
        --out "$out/cuda_e2e.json" \
        2>&1 | tee "$out/bench_e2e.log" | tail -80 ;;
    bench-quant)
      timeout "$(limit ${BENCH_TIMEOUT:-600})" $python benchmarks/bench_cuda_quant.py \
        ${QUANT_ARGS:-} --out "$out/cuda_quant.json" \
        2>&1 | tee "$out/bench_quant.log" | tail -30 ;;
    profile-attention)
      cases=("prefill --batch 1 --tokens 8192" "prefill --batch 1 --tokens 8192 --kernel mma64"
             "decode --batch 1 --tokens 160" "decode --batch 64 --tokens 8192")
      [ -n "${PROFILE_CASES:-}" ] && IFS=';' read -ra cases <<< "$PROFILE_CASES"
      for case in "${cases[@]}"; do
        name=$(echo "$case" | tr -d '-' | tr ' ' '_')
        timeout "$(limit 120)" ncu --clock-control none --section SpeedOfLight \
          --section ComputeWorkloadAnalysis --section Occupancy \
          --section WarpStateStats --section LaunchStats --kernel-name regex:paged_attention \
          --launch-skip 2 --launch-count 2 \
          $python benchmarks/profile_cuda_attention.py --case $case > "$out/ncu-$name.log" 2>&1
        echo "ncu $case: exit $?"
        grep -E "paged_attention|Duration|Compute \(SM\) Throughput|Memory Throughput|\
Achieved Occupancy|Registers Per|Stall" "$out/ncu-$name.log" | head -24
      done ;;
    profile-quant)
      cases=("--format int8 --tokens 8" "--format int8 --tokens 64" "--format int4 --tokens 8"
             "--format int4 --tokens 64")
      [ -n "${PROFILE_QUANT_CASES:-}" ] && IFS=';' read -ra cases <<< "$PROFILE_QUANT_CASES"
      for case in "${cases[@]}"; do
        name=$(echo "$case" | tr -d '-' | tr ' ' '_')
        timeout "$(limit 90)" ncu --clock-control none --section SpeedOfLight \
          --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section Occupancy \
          --section WarpStateStats --section LaunchStats \
          --kernel-name "regex:quantized_gemm_(mma|wide)" --launch-skip 2 --launch-count 1 \
          $python benchmarks/profile_cuda_quant.py $case > "$out/ncu-quant-$name.log" 2>&1
        echo "ncu quant $case: exit $?"
        grep -E "quantized_gemm|Duration|Compute \(SM\) Throughput|Memory Throughput|\
DRAM Throughput|L1/TEX Hit|L2 Hit|Achieved Occupancy|Registers Per|Issue Slots Busy|Executed Ipc A" \
          "$out/ncu-quant-$name.log" | head -16
      done ;;
    *) echo "cuda_session: unknown stage $stage"; status=1 ;;
  esac
done
echo "cuda_session: done in $(( $(date +%s) - start )) s"
exit $status
