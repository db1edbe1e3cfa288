#pragma once
// The CUDA body the gated activations share (silu_and_mul, gelu_tanh_and_mul,
// clamped_swiglu_and_mul): out = act(gate, up), fp32 math. Blocks tile each token's d outputs, so one token still spreads over several
// multiprocessors, and each thread issues all of its loads before it uses any: a decode step's
// single token costs one memory round trip, not one per strided iteration. Raw pointers only,
// no torch headers.

#include <cstdint>

#include "kernels/cuda_dtype.cuh"

namespace kvserve::cuda {

/// Threads of a gated-activation block, and outputs each thread takes (kGatedThreads apart).
constexpr int kGatedThreads = 256;
constexpr int kGatedPerThread = 4;

/// Blocks along a token's d outputs (grid.y).
inline unsigned int gated_activation_splits(int64_t d) {
  const int64_t per_block = static_cast<int64_t>(kGatedThreads) * kGatedPerThread;
  return static_cast<unsigned int>((d + per_block - 1) / per_block);
}

/// Grid (num_tokens, gated_activation_splits(d)), block kGatedThreads. input [num_tokens, 2d]
/// (gate then up) and out [num_tokens, d], row strides in elements. act: float(float gate,
/// float up), the gated output (with the parameters it holds).
template <typename T, typename Act>
__global__ void gated_activation_kernel(T* out, int64_t out_stride, const T* input,
                                        int64_t input_stride, int64_t d, Act act) {
  const T* gate = input + static_cast<int64_t>(blockIdx.x) * input_stride;
  const T* up = gate + d;
  T* dst = out + static_cast<int64_t>(blockIdx.x) * out_stride;
  const int64_t first =
      static_cast<int64_t>(blockIdx.y) * kGatedThreads * kGatedPerThread + threadIdx.x;
  float g[kGatedPerThread], u[kGatedPerThread];
#pragma unroll
  for (int j = 0; j < kGatedPerThread; ++j) {
    const int64_t i = first + j * kGatedThreads;
    g[j] = i < d ? to_float(gate[i]) : 0.0f;
    u[j] = i < d ? to_float(up[i]) : 0.0f;
  }
#pragma unroll
  for (int j = 0; j < kGatedPerThread; ++j) {
    const int64_t i = first + j * kGatedThreads;
    if (i < d) dst[i] = from_float<T>(act(g[j], u[j]));
  }
}

}  // namespace kvserve::cuda
