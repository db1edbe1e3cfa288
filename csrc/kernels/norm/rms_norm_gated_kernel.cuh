#pragma once
// CUDA body of rms_norm_gated (contract: rms_norm_gated.h): one block per (group, token), the
// group's (gated) values in fp32 reduced over the block, then normalized, weighted and gated in
// the contract's order; without a weight, the gate alone. Raw pointers only, no torch headers;
// the launcher checks shapes and dtypes.

#include <cstdint>

#include "kernels/cuda_dtype.cuh"
#include "kernels/cuda_reduce.cuh"

namespace kvserve::cuda {

__device__ inline float gated(float x, float z) { return x * z / (1.0f + __expf(-z)); }

__device__ inline float silu_of(float z) { return z / (1.0f + __expf(-z)); }

/// grid (dim / group_size, rows); gate may be null (not with a null weight); weight fp32 [dim],
/// or null for the gate alone.
template <typename T>
__global__ void rms_norm_gated_kernel(T* __restrict__ out, int64_t out_stride,
                                      const T* __restrict__ x, int64_t x_stride,
                                      const T* __restrict__ gate, int64_t gate_stride,
                                      const float* __restrict__ weight, int64_t group_size,
                                      float eps, bool norm_before_gate) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.y, first = static_cast<int64_t>(blockIdx.x) * group_size;
  const T* xr = x + row * x_stride + first;
  const T* zr = gate ? gate + row * gate_stride + first : nullptr;
  T* o = out + row * out_stride + first;
  if (!weight) {  // the gate alone
    for (int64_t i = threadIdx.x; i < group_size; i += blockDim.x) {
      o[i] = from_float<T>(to_float(xr[i]) * silu_of(to_float(zr[i])));
    }
    return;
  }
  const bool gate_first = zr && !norm_before_gate;
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < group_size; i += blockDim.x) {
    const float h = gate_first ? gated(to_float(xr[i]), to_float(zr[i])) : to_float(xr[i]);
    sum += h * h;
  }
  const float inv = rsqrtf(block_sum(sum, scratch) / static_cast<float>(group_size) + eps);
  for (int64_t i = threadIdx.x; i < group_size; i += blockDim.x) {
    if (norm_before_gate) {  // FalconH1: all in fp32, rounded once
      const float g = zr ? silu_of(to_float(zr[i])) : 1.0f;
      o[i] = from_float<T>(to_float(xr[i]) * inv * weight[first + i] * g);
    } else {
      const float h = gate_first ? gated(to_float(xr[i]), to_float(zr[i])) : to_float(xr[i]);
      o[i] = from_float<T>(to_float(from_float<T>(h * inv)) * weight[first + i]);
    }
  }
}

}  // namespace kvserve::cuda
