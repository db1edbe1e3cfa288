#pragma once
// Runtime CPU-capability dispatch for the vectorized CPU kernels.
//
// Each `*_cpu_kernel.cpp` is compiled once per capability (DEFAULT, AVX2, AVX512 on x86-64), with
// CPU_CAPABILITY naming the variant, and registers its function into a CpuKernelStub. The launcher
// calls `stub()` which returns the best variant the running CPU supports. No -march=native.

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

namespace kvserve::cpu {

/// Vector instruction sets a kernel variant may use, in increasing order.
enum class Capability : int { kDefault = 0, kAvx2 = 1, kAvx512 = 2 };
inline constexpr int kNumCapabilities = 3;

/// The capability kernels run with: the best the CPU supports, lowered (never raised) by the
/// environment variable KVSERVE_CPU_CAPABILITY=default|avx2|avx512. Detected once.
Capability cpu_capability();

/// "default", "avx2" or "avx512".
const char* capability_name(Capability capability);

/// Whether the CPU multiplies `dtype` natively in a GEMM: always for fp32; bf16 with AVX-512 BF16
/// or AMX-BF16, fp16 with AVX-512 FP16 or AMX-FP16 (detected once). Without, a reduced-precision
/// GEMM converts as it goes and runs several times slower than fp32's (6x for bf16 on an AVX2
/// Zen 4 VM, benchmarks/bench_quant.py --only prefill), so launchers run those products in fp32.
bool has_native_gemm(c10::ScalarType dtype);

/// One kernel, compiled once per capability; a slot stays null when that variant was not built.
template <typename Fn>
struct CpuKernelStub {
  Fn impls[kNumCapabilities] = {};

  /// The best registered variant at or below cpu_capability(). Throws if none was built.
  Fn get() const {
    for (int c = static_cast<int>(cpu_capability()); c >= 0; --c) {
      if (impls[c] != nullptr) return impls[c];
    }
    TORCH_CHECK(false, "kvserve: no CPU kernel variant was built for this operation");
  }
};

}  // namespace kvserve::cpu

/// Defines a stub visible to the launcher and the per-capability kernel files.
#define KVSERVE_CPU_STUB(name, fn_type) inline ::kvserve::cpu::CpuKernelStub<fn_type> name

/// Registers `fn` as this translation unit's capability variant of `stub`.
#define KVSERVE_REGISTER_CPU_KERNEL(stub, fn)                        \
  static const bool kvserve_registered_##stub [[maybe_unused]] =      \
      (stub.impls[KVSERVE_CAPABILITY_INDEX] = (fn), true)
