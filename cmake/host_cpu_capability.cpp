// Prints the CPU kernel variants this machine runs, as a CMake list, by the same tests as
// detect() in csrc/kernels/cpu_dispatch.cpp (which picks a variant at run time). Run by CMake at
// configure time: a build for this machine compiles only the variants it can use
// (csrc/CMakeLists.txt).
#include <cstdio>

#if defined(__linux__) && (defined(__x86_64__) || defined(_M_X64))
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

// AMX-TILE and AMX-INT8, with the tiles granted to the process (cpu_dispatch.cpp's amx_int8_usable).
static bool amx_int8_usable() {
#if defined(__linux__) && (defined(__x86_64__) || defined(_M_X64))
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  if (!(edx & (1u << 24)) || !(edx & (1u << 25))) return false;
  return syscall(SYS_arch_prctl, 0x1023L, 18L) == 0;
#else
  return false;
#endif
}

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
  if (avx512 && __builtin_cpu_supports("avx512vnni") && amx_int8_usable()) {
    std::printf(";AVX512_AMX");
  }
#endif
  std::printf("\n");
  return 0;
}
