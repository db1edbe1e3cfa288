#pragma once
// fp32 conversions of the CUDA kernel bodies' element types (float, bf16, fp16): they load as fp32
// and store rounded to nearest. And the entry types of KV caches (plain, int8, fp8 E4M3).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace kvserve::cuda {

template <typename T>
__device__ inline float to_float(T x) {
  return static_cast<float>(x);
}
template <>
__device__ inline float to_float(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <>
__device__ inline float to_float(__half x) {
  return __half2float(x);
}

template <typename T>
__device__ inline T from_float(float x) {
  return static_cast<T>(x);
}
template <>
__device__ inline __nv_bfloat16 from_float(float x) {
  return __float2bfloat16(x);
}
template <>
__device__ inline __half from_float(float x) {
  return __float2half(x);
}

/// How a cache stores its entries (matches cpu::KVCacheFormat).
enum class KVFormat : int { kPlain = 0, kInt8 = 1, kFp8E4M3 = 2 };

/// The entry type of a cache of format F holding values of T.
template <typename T, KVFormat F>
struct KVEntry {
  using type = T;
};
template <typename T>
struct KVEntry<T, KVFormat::kInt8> {
  using type = int8_t;
};
template <typename T>
struct KVEntry<T, KVFormat::kFp8E4M3> {
  using type = __nv_fp8_e4m3;
};

/// An entry of a KV cache as fp32, before its row's scale.
__device__ inline float entry_to_float(int8_t x) { return static_cast<float>(x); }
__device__ inline float entry_to_float(__nv_fp8_e4m3 x) { return static_cast<float>(x); }
template <typename T>
__device__ inline float entry_to_float(T x) {
  return to_float(x);
}

}  // namespace kvserve::cuda
