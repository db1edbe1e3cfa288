// Prints the best CPU kernel variant this machine runs, by the same test as detect() in
// csrc/kernels/cpu_dispatch.cpp (which picks a variant at run time). Run by CMake at configure
// time: a build for this machine compiles only the variants it can use (csrc/CMakeLists.txt).
#include <cstdio>

int main() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    std::puts("AVX512");
    return 0;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    std::puts("AVX2");
    return 0;
  }
#endif
  std::puts("DEFAULT");
  return 0;
}
