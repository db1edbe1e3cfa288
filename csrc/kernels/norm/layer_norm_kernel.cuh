#pragma once
// CUDA body of layer_norm (contract: layer_norm.h): one block per token; the row's sum, then
// its squared deviations from the mean, each reduced over the block in fp32; then one rounding
// of (x - mean) * rsqrt(var + eps) * w (+ b). The row is read three times (from L2 after the
// first): a LayerNorm runs twice per layer, where the projections read far more. Raw pointers
// only, no torch headers; the launcher checks shapes and dtypes.

#include <cstdint>

#include "kernels/cuda_dtype.cuh"
#include "kernels/cuda_reduce.cuh"

namespace kvserve::cuda {

/// Grid (num_tokens), block a multiple of 32 (at most 1024); weight and bias fp32 [hidden], bias
/// may be null. In place (out == input) is allowed: each thread rewrites only what it read.
template <typename T>
__global__ void layer_norm_kernel(T* out, int64_t out_stride, const T* input,
                                  int64_t input_stride, const float* __restrict__ weight,
                                  const float* __restrict__ bias, int64_t hidden, float epsilon) {
  __shared__ float scratch[32];
  const T* x = input + blockIdx.x * input_stride;
  T* y = out + blockIdx.x * out_stride;
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) sum += to_float(x[i]);
  const float mean = block_sum(sum, scratch) / static_cast<float>(hidden);
  float squares = 0.0f;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float d = to_float(x[i]) - mean;
    squares += d * d;
  }
  const float inv = rsqrtf(block_sum(squares, scratch) / static_cast<float>(hidden) + epsilon);
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    float v = (to_float(x[i]) - mean) * inv * weight[i];
    if (bias) v += bias[i];
    y[i] = from_float<T>(v);
  }
}

}  // namespace kvserve::cuda
