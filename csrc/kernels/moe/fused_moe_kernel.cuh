#pragma once
// CUDA body of fused_moe (contract: fused_moe.h) over expert weights stacked per projection:
// w13 [num_experts, 2 * inter, hidden], w2 [num_experts, hidden, inter]. Two passes: one thread
// per (token-slot pair, intermediate unit) computes the SwiGLU activation from the gate and up
// rows of its expert; one thread per (token, output unit) runs the down rows of each of the
// token's experts and sums them with the routing weights. fp32 accumulation. A plain baseline:
// every thread reads its weight rows from global memory (no tiling through shared memory yet).
// Raw pointers only, no torch headers; the launcher checks shapes, dtypes and expert ids.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/cuda_dtype.cuh"

#include <cstdint>

namespace kvserve::cuda {

namespace moe_detail {

template <typename A, typename B>
__device__ inline float dot(const A* a, const B* b, int64_t n) {
  float acc = 0.0f;
  for (int64_t i = 0; i < n; ++i) acc += to_float(a[i]) * to_float(b[i]);
  return acc;
}

}  // namespace moe_detail

/// act[p, i] = silu(x . gate_e[i]) * (x . up_e[i]) for pair p = t * k + j, e = topk_ids[p],
/// x = hidden[t]. Grid (num_pairs, ceil(inter / blockDim.x)). act: fp32 [num_pairs, inter].
template <typename T>
__global__ void moe_gate_up_kernel(const T* hidden, int64_t hidden_stride, const T* w13,
                                   const int64_t* topk_ids, int64_t k, int64_t hidden_size,
                                   int64_t inter, float* act) {
  const int64_t pair = blockIdx.x;
  const int64_t i = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (i >= inter) return;
  const T* x = hidden + (pair / k) * hidden_stride;
  const T* w = w13 + topk_ids[pair] * 2 * inter * hidden_size;
  const float gate = moe_detail::dot(x, w + i * hidden_size, hidden_size);
  const float up = moe_detail::dot(x, w + (inter + i) * hidden_size, hidden_size);
  act[pair * inter + i] = gate / (1.0f + __expf(-gate)) * up;
}

/// out[t, c] = sum_j topk_weights[t, j] * (act[t * k + j] . down_e[c]), e = topk_ids[t * k + j].
/// Grid (num_tokens, ceil(hidden_size / blockDim.x)). out: [num_tokens, hidden_size] contiguous.
template <typename T>
__global__ void moe_down_combine_kernel(const float* act, const T* w2, const int64_t* topk_ids,
                                        const float* topk_weights, int64_t k,
                                        int64_t hidden_size, int64_t inter, T* out) {
  const int64_t t = blockIdx.x;
  const int64_t c = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (c >= hidden_size) return;
  float acc = 0.0f;
  for (int64_t j = 0; j < k; ++j) {
    const int64_t pair = t * k + j;
    const T* w = w2 + (topk_ids[pair] * hidden_size + c) * inter;
    acc += topk_weights[pair] * moe_detail::dot(act + pair * inter, w, inter);
  }
  out[t * hidden_size + c] = from_float<T>(acc);
}

}  // namespace kvserve::cuda
