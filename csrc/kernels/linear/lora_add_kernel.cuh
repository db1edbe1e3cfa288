#pragma once
// CUDA body of lora_add (contract: lora_add.h): one thread block per token. Each warp shrinks
// rows of A_s against the input row (lanes stride over in_features, a shuffle reduction per row)
// into shared memory; then the threads stride over the outputs, each adding its column of B_s^T
// times the shrunk vector. fp32 math, one rounding per output. Raw pointers only, no torch
// headers; the launcher checks shapes and dtypes.

#include <cstdint>

#include "kernels/cuda_dtype.cuh"
#include "kernels/cuda_mma.cuh"
#include "kernels/cuda_reduce.cuh"

namespace kvserve::cuda {

/// Grid (num_tokens), a multiple of 32 threads, rank floats of dynamic shared memory.
template <typename T>
__global__ void lora_add_kernel(T* out, int64_t out_stride, const T* x, int64_t x_stride,
                                const T* lora_a, const T* lora_b, const int32_t* slots,
                                const float* scales, int num_slots, int64_t in_features,
                                int64_t out_features, int rank) {
  float* shrunk = static_cast<float*>(dynamic_shared_memory());  // [rank]
  const int64_t t = blockIdx.x;
  const int s = slots[t];
  if (s < 0 || s >= num_slots) return;  // the whole block leaves together
  const T* row = x + t * x_stride;
  const T* a_s = lora_a + static_cast<int64_t>(s) * rank * in_features;
  const T* b_s = lora_b + static_cast<int64_t>(s) * rank * out_features;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  for (int r = warp; r < rank; r += warps) {
    float dot = 0.0f;
    for (int64_t i = lane; i < in_features; i += 32) {
      dot += to_float(a_s[r * in_features + i]) * to_float(row[i]);
    }
    dot = warp_sum(dot);
    if (lane == 0) shrunk[r] = dot * scales[s];
  }
  __syncthreads();
  T* dst = out + t * out_stride;
  for (int64_t j = threadIdx.x; j < out_features; j += blockDim.x) {
    float acc = to_float(dst[j]);
    for (int r = 0; r < rank; ++r) acc += shrunk[r] * to_float(b_s[r * out_features + j]);
    dst[j] = from_float<T>(acc);
  }
}

}  // namespace kvserve::cuda
