#pragma once
// Runtime CPU-capability dispatch for the vectorized CPU kernels.
//
// Each `*_cpu_kernel.cpp` is compiled once per base capability (DEFAULT, AVX2, AVX512 on x86-64),
// with CPU_CAPABILITY naming the variant, and registers its function into a CpuKernelStub. The
// kernels whose integer dot products have an instruction of their own (vpdpbusd) are compiled
// for the extensions too: AVX2_VNNI (AVX-VNNI: Alder Lake, Zen 5), AVX512_VNNI (Cascade Lake,
// Ice Lake, Sapphire Rapids, Zen 4) and AVX512_AMX (AVX-512 VNNI with AMX int8 tiles: Sapphire
// Rapids and later, where the kernel's process may use the tiles). The launcher calls `stub.get()`, which returns the best
// variant the running CPU supports. No -march=native.

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

namespace kvserve::cpu {

/// Vector instruction sets a kernel variant may use, in order of preference. Not a chain: a CPU
/// may have AVX-512 VNNI without AVX-VNNI (Ice Lake), so each is checked on its own (supports).
enum class Capability : int {
  kDefault = 0,
  kAvx2 = 1,
  kAvx2Vnni = 2,  // AVX2 + AVX-VNNI (VEX vpdpbusd)
  kAvx512 = 3,    // AVX-512 F, BW, VL, DQ
  kAvx512Vnni = 4,  // AVX512 + AVX-512 VNNI
  kAvx512Amx = 5,   // AVX512_VNNI + AMX-TILE and AMX-INT8, the tiles granted by the OS
};
inline constexpr int kNumCapabilities = 6;

/// Whether this CPU runs `capability`'s instructions (detected once).
bool supports(Capability capability);

/// The capability kernels run with: the best the CPU supports, lowered (never raised) by the
/// environment variable KVSERVE_CPU_CAPABILITY (a capability_name) to the best supported one at
/// or below it. Detected once.
Capability cpu_capability();

/// "default", "avx2", "avx2_vnni", "avx512", "avx512_vnni" or "avx512_amx".
const char* capability_name(Capability capability);

/// Whether the CPU multiplies `dtype` natively in a GEMM: always for fp32; bf16 with AVX-512 BF16
/// or AMX-BF16, fp16 with AVX-512 FP16 or AMX-FP16 (detected once). Without, a reduced-precision
/// GEMM converts as it goes and runs several times slower than fp32's (6x for bf16 on an AVX2
/// Zen 4 VM, benchmarks/bench_quant.py --only prefill), so launchers run those products in fp32.
bool has_native_gemm(c10::ScalarType dtype);

/// How kernels that read a weight once a call ask for its lines ahead of their reads
/// (prefetch_stream in cpu_vec.h). Measured at one token on a streamed [5632, 2048] int8 and
/// int4 projection with int8 inputs (2 threads, interleaved processes): on a Zen 4 VM
/// non-temporal requests read it 1.05-1.2x faster than prefetcht0, and t1 / t2 were slower than
/// t0; on an Intel Xeon (Emerald Rapids) VM they read it at half the speed of t0, t1 or t2
/// (6.6-9.9 GB/s against 13-20), t1 the best of those by a little.
enum class StreamPrefetch : int {
  kNonTemporal = 0,  // prefetchnta: into L1, past the other levels
  kL2 = 1,           // prefetcht1: into L2
};

/// kNonTemporal on AMD CPUs, kL2 on the others; the environment variable KVSERVE_CPU_PREFETCH
/// ("nta" or "t1") overrides it (benchmarks). Detected once.
StreamPrefetch stream_prefetch();

/// "nta" or "t1".
const char* stream_prefetch_name(StreamPrefetch prefetch);

/// One kernel, compiled once per capability; a slot stays null when that variant was not built.
template <typename Fn>
struct CpuKernelStub {
  Fn impls[kNumCapabilities] = {};

  /// The best registered variant at or below cpu_capability() that the CPU supports. Throws if
  /// none was built.
  Fn get() const {
    for (int c = static_cast<int>(cpu_capability()); c >= 0; --c) {
      if (impls[c] != nullptr && supports(static_cast<Capability>(c))) return impls[c];
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
