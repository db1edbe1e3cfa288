#pragma once
// fp32 conversions of the CUDA kernel bodies' element types (float, bf16, fp16): they load as fp32
// and store rounded to nearest.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

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

}  // namespace kvserve::cuda
