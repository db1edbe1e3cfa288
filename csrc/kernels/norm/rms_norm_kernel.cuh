#pragma once
// CUDA bodies of rms_norm and fused_add_rms_norm (contract: rms_norm.h): one block per token,
// fp32 sum of squares reduced over the block, one rounding of x * rsqrt(mean + eps) * w. Raw
// pointers only, no torch headers; the launcher checks shapes and dtypes.

#include <cstdint>

#include "kernels/cuda_dtype.cuh"
#include "kernels/cuda_reduce.cuh"

namespace kvserve::cuda {

/// Grid (num_tokens), block a multiple of 32. W is T or float (Gemma's fp32 1 + w).
template <typename T, typename W>
__global__ void rms_norm_kernel(T* out, int64_t out_stride, const T* input, int64_t input_stride,
                                const W* weight, int64_t hidden, float epsilon) {
  __shared__ float scratch[32];
  const T* x = input + blockIdx.x * input_stride;
  T* y = out + blockIdx.x * out_stride;
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float v = to_float(x[i]);
    sum += v * v;
  }
  const float scale = rsqrtf(block_sum(sum, scratch) / static_cast<float>(hidden) + epsilon);
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    y[i] = from_float<T>(to_float(x[i]) * scale * to_float(weight[i]));
  }
}

/// Grid (num_tokens), block a multiple of 32. In place: residual = round(residual + input), then
/// input = rms_norm(residual) * weight.
template <typename T, typename W>
__global__ void fused_add_rms_norm_kernel(T* input, int64_t input_stride, T* residual,
                                          int64_t residual_stride, const W* weight,
                                          int64_t hidden, float epsilon) {
  __shared__ float scratch[32];
  T* x = input + blockIdx.x * input_stride;
  T* r = residual + blockIdx.x * residual_stride;
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    const T rounded = from_float<T>(to_float(r[i]) + to_float(x[i]));
    r[i] = rounded;
    const float v = to_float(rounded);
    sum += v * v;
  }
  const float scale = rsqrtf(block_sum(sum, scratch) / static_cast<float>(hidden) + epsilon);
  // Each thread reads back only the residual entries it wrote itself: no barrier needed.
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    x[i] = from_float<T>(to_float(r[i]) * scale * to_float(weight[i]));
  }
}

}  // namespace kvserve::cuda
