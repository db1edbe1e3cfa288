#pragma once
// CUDA body of silu_and_mul (contract: silu_and_mul.h): one thread block per token, threads
// striding over the d outputs; fp32 math. Raw pointers only, no torch headers; the launcher
// checks shapes and dtypes.

#include <cstdint>

#include "kernels/cuda_dtype.cuh"

namespace kvserve::cuda {

/// Grid (num_tokens), any block size. input [num_tokens, 2d] and out [num_tokens, d] with row
/// strides in elements.
template <typename T>
__global__ void silu_and_mul_kernel(T* out, int64_t out_stride, const T* input,
                                    int64_t input_stride, int64_t d) {
  const T* gate = input + static_cast<int64_t>(blockIdx.x) * input_stride;
  const T* up = gate + d;
  T* dst = out + static_cast<int64_t>(blockIdx.x) * out_stride;
  for (int64_t i = threadIdx.x; i < d; i += blockDim.x) {
    const float g = to_float(gate[i]);
    dst[i] = from_float<T>(g / (1.0f + expf(-g)) * to_float(up[i]));
  }
}

}  // namespace kvserve::cuda
