// Prints the CPU kernel variants this machine runs, as a CMake list, by the same tests as
// detect() in csrc/kernels/cpu_dispatch.cpp (which picks a variant at run time). Run by CMake at
// configure time: a build for this machine compiles only the variants it can use
// (csrc/CMakeLists.txt).
#include <cstdio>

int main() {
  std::printf("DEFAULT");
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (avx2) std::printf(";AVX2");
  if (avx2 && __builtin_cpu_supports("avxvnni")) std::printf(";AVX2_VNNI");
  if (avx512) std::printf(";AVX512");
  if (avx512 && __builtin_cpu_supports("avx512vnni")) std::printf(";AVX512_VNNI");
#endif
  std::printf("\n");
  return 0;
}
