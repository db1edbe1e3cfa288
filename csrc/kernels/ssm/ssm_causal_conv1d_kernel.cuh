#pragma once
// CUDA body of ssm_causal_conv1d (contract: ssm_causal_conv1d.h): one thread per (sequence,
// channel), which runs the sequence's tokens in order with the channel's window in registers.
// Sequences whose slot or token range is out of bounds are skipped. Raw pointers only.

#include <cstdint>

#include "kernels/cuda_dtype.cuh"

namespace kvserve::cuda {

/// grid (ceil(dim / blockDim.x), num_seqs); weight fp32 [dim, kernel], bias fp32 or null.
template <typename T, typename S>
__global__ void ssm_causal_conv1d_kernel(T* __restrict__ out, int64_t out_stride,
                                         const T* __restrict__ x, int64_t x_stride,
                                         const float* __restrict__ weight,
                                         const float* __restrict__ bias, S* __restrict__ conv_state,
                                         const int32_t* __restrict__ cu_seqlens,
                                         const int32_t* __restrict__ slots,
                                         const bool* __restrict__ has_initial_state,
                                         int64_t num_tokens, int64_t num_slots, int64_t dim,
                                         int kernel, bool silu) {
  const int64_t s = blockIdx.y, c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= dim) return;
  const int64_t slot = slots[s], begin = cu_seqlens[s], end = cu_seqlens[s + 1];
  if (slot < 0 || slot >= num_slots || begin < 0 || end < begin || end > num_tokens) return;
  const int history = kernel - 1;
  S* state = conv_state + (slot * dim + c) * history;
  float window[16];
  for (int j = 0; j < history; ++j) {
    window[j] = has_initial_state[s] ? to_float(state[j]) : 0.0f;
  }
  const float* w = weight + c * kernel;
  const float b = bias ? bias[c] : 0.0f;
  for (int64_t t = begin; t < end; ++t) {
    window[history] = to_float(x[t * x_stride + c]);
    float v = b;
    for (int j = 0; j < kernel; ++j) v += w[j] * window[j];
    out[t * out_stride + c] = from_float<T>(silu ? v / (1.0f + __expf(-v)) : v);
    for (int j = 0; j < history; ++j) window[j] = window[j + 1];
  }
  for (int j = 0; j < history; ++j) state[j] = from_float<S>(window[j]);
}

}  // namespace kvserve::cuda
