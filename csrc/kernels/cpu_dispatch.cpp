#include "kernels/cpu_dispatch.h"

#include <ATen/cpu/Utils.h>

#include <array>
#include <cstdlib>
#include <cstring>

#if defined(__linux__) && (defined(__x86_64__) || defined(_M_X64))
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace kvserve::cpu {
namespace {

// AMX-TILE and AMX-INT8 (CPUID leaf 7: EDX bits 24, 25), with Linux letting this process use the
// tiles' 8 KB of state (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA, feature 18; without it the
// first tile instruction faults). The request holds for every thread of the process.
bool amx_int8_usable() {
#if defined(__linux__) && (defined(__x86_64__) || defined(_M_X64))
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  if (!(edx & (1u << 24)) || !(edx & (1u << 25))) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

// The same tests as cmake/host_cpu_capability.cpp, which picks the variants a build holds.
bool detect(Capability capability) {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  switch (capability) {
    case Capability::kDefault: return true;
    case Capability::kAvx2: return avx2;
    case Capability::kAvx2Vnni: return avx2 && __builtin_cpu_supports("avxvnni");
    case Capability::kAvx512: return avx512;
    case Capability::kAvx512Vnni: return avx512 && __builtin_cpu_supports("avx512vnni");
    case Capability::kAvx512Amx:
      return avx512 && __builtin_cpu_supports("avx512vnni") && amx_int8_usable();
  }
  return false;
#else
  return capability == Capability::kDefault;
#endif
}

// The best supported capability at or below `limit`.
Capability best_at_or_below(int limit) {
  for (int c = limit; c > 0; --c) {
    if (supports(static_cast<Capability>(c))) return static_cast<Capability>(c);
  }
  return Capability::kDefault;
}

}  // namespace

bool supports(Capability capability) {
  static const auto flags = [] {
    std::array<bool, kNumCapabilities> all{};
    for (int c = 0; c < kNumCapabilities; ++c) all[c] = detect(static_cast<Capability>(c));
    return all;
  }();
  return flags[static_cast<int>(capability)];
}

Capability cpu_capability() {
  static const Capability capability = [] {
    int limit = kNumCapabilities - 1;
    // Lowering is allowed for testing the other variants; raising would execute illegal
    // instructions. An unknown name changes nothing.
    if (const char* requested = std::getenv("KVSERVE_CPU_CAPABILITY")) {
      for (int c = 0; c < kNumCapabilities; ++c) {
        if (std::strcmp(requested, capability_name(static_cast<Capability>(c))) == 0) limit = c;
      }
    }
    return best_at_or_below(limit);
  }();
  return capability;
}

StreamPrefetch stream_prefetch() {
  static const StreamPrefetch prefetch = [] {
    if (const char* requested = std::getenv("KVSERVE_CPU_PREFETCH")) {
      for (StreamPrefetch p : {StreamPrefetch::kNonTemporal, StreamPrefetch::kL2}) {
        if (std::strcmp(requested, stream_prefetch_name(p)) == 0) return p;
      }
    }
#if defined(__x86_64__) || defined(_M_X64)
    __builtin_cpu_init();
    if (__builtin_cpu_is("amd")) return StreamPrefetch::kNonTemporal;
#endif
    return StreamPrefetch::kL2;
  }();
  return prefetch;
}

const char* stream_prefetch_name(StreamPrefetch prefetch) {
  return prefetch == StreamPrefetch::kNonTemporal ? "nta" : "t1";
}

bool has_native_gemm(c10::ScalarType dtype) {
  static const auto flags = at::cpu::get_cpu_capabilities();
  const auto has = [](const char* name) {
    auto it = flags.find(name);
    return it != flags.end() && it->second.isBool() && it->second.toBool();
  };
  static const bool bf16 = has("avx512_bf16") || has("amx_bf16");
  static const bool fp16 = has("avx512_fp16") || has("amx_fp16");
  switch (dtype) {
    case c10::ScalarType::Float: return true;
    case c10::ScalarType::BFloat16: return bf16;
    case c10::ScalarType::Half: return fp16;
    default: return false;
  }
}

const char* capability_name(Capability capability) {
  switch (capability) {
    case Capability::kAvx512Amx: return "avx512_amx";
    case Capability::kAvx512Vnni: return "avx512_vnni";
    case Capability::kAvx512: return "avx512";
    case Capability::kAvx2Vnni: return "avx2_vnni";
    case Capability::kAvx2: return "avx2";
    default: return "default";
  }
}

}  // namespace kvserve::cpu
