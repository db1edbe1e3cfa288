#include "kernels/cpu_dispatch.h"

#include <ATen/cpu/Utils.h>

#include <cstdlib>
#include <cstring>

namespace kvserve::cpu {
namespace {

Capability detect() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    return Capability::kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Capability::kAvx2;
#endif
  return Capability::kDefault;
}

Capability from_environment(Capability detected) {
  const char* requested = std::getenv("KVSERVE_CPU_CAPABILITY");
  if (requested == nullptr) return detected;
  Capability wanted = detected;
  if (std::strcmp(requested, "default") == 0) wanted = Capability::kDefault;
  if (std::strcmp(requested, "avx2") == 0) wanted = Capability::kAvx2;
  if (std::strcmp(requested, "avx512") == 0) wanted = Capability::kAvx512;
  // Lowering is allowed for testing the other variants; raising would execute illegal instructions.
  return static_cast<int>(wanted) < static_cast<int>(detected) ? wanted : detected;
}

}  // namespace

Capability cpu_capability() {
  static const Capability capability = from_environment(detect());
  return capability;
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
    case Capability::kAvx512: return "avx512";
    case Capability::kAvx2: return "avx2";
    default: return "default";
  }
}

}  // namespace kvserve::cpu
