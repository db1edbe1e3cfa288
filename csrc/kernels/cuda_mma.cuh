#pragma once
// Tensor-core and asynchronous-copy primitives of the CUDA kernel bodies (sm_80 and later): the
// warp-wide m16n8k16 matrix multiply-accumulate in fp32 of bf16 or fp16 operands, ldmatrix
// (four 8x8 tiles of 16-bit entries from shared memory, optionally transposed), 4-, 8- and
// 16-byte cp.async copies from global to shared memory in commit groups, and the block's dynamic
// shared memory (a kernel that takes it from here runs in the emulator). Fragment layouts are PTX's
// (lane = 4 * g + c): A (16 x 16, row-major) a0 = A[g][2c, 2c+1], a1 = A[g+8][2c, 2c+1],
// a2 = A[g][2c+8, 2c+9], a3 = A[g+8][2c+8, 2c+9]; B (16 x 8, by column) b0 = B[2c, 2c+1][g],
// b1 = B[2c+8, 2c+9][g]; C (16 x 8, fp32) c0, c1 = C[g][2c, 2c+1], c2, c3 = C[g+8][2c, 2c+1].
// Under KVSERVE_CUDA_EMULATOR (tests/cpp/cuda_emulator.h) the host emulator defines them.

#include <cstdint>

#include "kernels/cuda_dtype.cuh"

namespace kvserve::cuda {

/// Two entries of T (bf16 or fp16) packed in one register, `low` in the low half.
template <typename T>
__device__ inline uint32_t pack_pair(float low, float high) {
  const T l = from_float<T>(low), h = from_float<T>(high);
  uint16_t lb, hb;
  static_assert(sizeof(T) == 2, "pack_pair packs 16-bit entries");
  __builtin_memcpy(&lb, &l, 2);
  __builtin_memcpy(&hb, &h, 2);
  return static_cast<uint32_t>(lb) | (static_cast<uint32_t>(hb) << 16);
}

/// 2^x by the special-function unit's approximation (2 ulp), subnormal results flushed to zero:
/// an online softmax's exponentials, without exp2f's rescaling of subnormal inputs.
__device__ inline float exp2_approx(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
#else
  return exp2f(x);
#endif
}

#ifdef KVSERVE_CUDA_EMULATOR
template <typename T>
void mma_m16n8k16(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]);
template <>
void mma_m16n8k16<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]);
template <>
void mma_m16n8k16<__half>(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]);
template <bool TRANSPOSE>
void ldmatrix_x4(uint32_t (&r)[4], const void* shared_row);
template <>
void ldmatrix_x4<false>(uint32_t (&r)[4], const void* shared_row);
template <>
void ldmatrix_x4<true>(uint32_t (&r)[4], const void* shared_row);
void cp_async_16(void* shared_dst, const void* global_src, bool fill);
void cp_async_8(void* shared_dst, const void* global_src, bool fill);
void cp_async_4(void* shared_dst, const void* global_src, bool fill);
void cp_async_commit();
template <int PENDING>
void cp_async_wait();
void* dynamic_shared_memory();
#else
// A build for an architecture before sm_80 (CMAKE_CUDA_ARCHITECTURES=75) compiles these as traps;
// the launchers never pick a kernel that uses them on such a GPU.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define KVSERVE_SM80(...) __trap()
#else
#define KVSERVE_SM80(...) __VA_ARGS__
#endif

/// c += A * B for the warp's 16 x 16 A and 16 x 8 B fragments (layouts above); T: __nv_bfloat16
/// or __half.
template <typename T>
__device__ inline void mma_m16n8k16(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]);
template <>
__device__ inline void mma_m16n8k16<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4],
                                                   const uint32_t (&b)[2]) {
  KVSERVE_SM80(asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1])));
}
template <>
__device__ inline void mma_m16n8k16<__half>(float (&c)[4], const uint32_t (&a)[4],
                                            const uint32_t (&b)[2]) {
  KVSERVE_SM80(asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1])));
}

/// Four 8 x 8 tiles of 16-bit entries: lanes 8i..8i+7 give the 16-byte-aligned shared addresses
/// of tile i's rows; r[i] holds tile i's entries [g][2c, 2c+1] ([2c, 2c+1][g] transposed).
template <bool TRANSPOSE>
__device__ inline void ldmatrix_x4(uint32_t (&r)[4], const void* shared_row) {
  [[maybe_unused]] const uint32_t address =
      static_cast<uint32_t>(__cvta_generic_to_shared(shared_row));
  if constexpr (TRANSPOSE) {
    KVSERVE_SM80(asm volatile(
        "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
        : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
        : "r"(address)));
  } else {
    KVSERVE_SM80(asm volatile(
        "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
        : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
        : "r"(address)));
  }
}

/// Starts copying 16 bytes (both addresses 16-byte aligned); !fill writes zeros instead and
/// reads nothing.
__device__ inline void cp_async_16(void* shared_dst, const void* global_src, bool fill) {
  [[maybe_unused]] const uint32_t address =
      static_cast<uint32_t>(__cvta_generic_to_shared(shared_dst));
  [[maybe_unused]] const int bytes = fill ? 16 : 0;
  KVSERVE_SM80(asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                            ::"r"(address), "l"(global_src), "r"(bytes)));
}

/// The same for 8 bytes (both addresses 8-byte aligned).
__device__ inline void cp_async_8(void* shared_dst, const void* global_src, bool fill) {
  [[maybe_unused]] const uint32_t address =
      static_cast<uint32_t>(__cvta_generic_to_shared(shared_dst));
  [[maybe_unused]] const int bytes = fill ? 8 : 0;
  KVSERVE_SM80(asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n"
                            ::"r"(address), "l"(global_src), "r"(bytes)));
}

/// The same for 4 bytes (both addresses 4-byte aligned).
__device__ inline void cp_async_4(void* shared_dst, const void* global_src, bool fill) {
  [[maybe_unused]] const uint32_t address =
      static_cast<uint32_t>(__cvta_generic_to_shared(shared_dst));
  [[maybe_unused]] const int bytes = fill ? 4 : 0;
  KVSERVE_SM80(asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n"
                            ::"r"(address), "l"(global_src), "r"(bytes)));
}

/// Closes the group of copies this thread started since the last commit.
__device__ inline void cp_async_commit() {
  KVSERVE_SM80(asm volatile("cp.async.commit_group;\n" ::));
}

/// Waits until at most PENDING of this thread's committed groups are still in flight (other
/// threads' copies need a __syncthreads after their wait).
template <int PENDING>
__device__ inline void cp_async_wait() {
  KVSERVE_SM80(asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING)));
}

/// The block's dynamic shared memory, 16-byte aligned.
__device__ inline void* dynamic_shared_memory() {
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  return shared_bytes;
}
#endif

}  // namespace kvserve::cuda
