#pragma once
// CUDA body of fused_moe (contract: fused_moe.h) over one weight tensor per expert, reached
// through device arrays of pointers: w13[e] [2 * inter, hidden], w2[e] [hidden, inter], both
// contiguous. Two passes: one warp per (token-slot pair, intermediate unit) computes the SwiGLU
// activation from the gate and up rows of its expert; one warp per (token, output unit) runs the
// down rows of each of the token's experts and sums them with the routing weights. Lanes read
// consecutive elements of a row and reduce with shuffles; fp32 accumulation. A plain baseline:
// no grouping of the tokens by expert and no tiling through shared memory yet (a token's result
// depends on nothing else in its batch). The launcher checks shapes and dtypes but cannot check
// the ids on the device without synchronising: an id outside [0, num_experts) contributes
// nothing. Raw pointers only, no torch headers.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/cuda_dtype.cuh"
#include "kernels/cuda_reduce.cuh"

namespace kvserve::cuda {

/// The experts' gate of a gate value g and an up value u: silu(g) * u (limit 0), or gpt-oss's
/// clamped SwiGLU (clamped_swiglu_and_mul.h); ungated (Nemotron-H's relu2), relu(u)^2 of an up
/// value alone.
struct MoeGate {
  float alpha, limit;
  bool ungated = false;
  __device__ float operator()(float g, float u) const {
    if (ungated) return u > 0.0f ? u * u : 0.0f;
    if (limit <= 0.0f) return g / (1.0f + __expf(-g)) * u;
    g = fminf(g, limit);
    u = fminf(fmaxf(u, -limit), limit);
    return (u + 1.0f) * (g / (1.0f + __expf(-alpha * g)));
  }
};

/// act[p, i] = gate(x . gate_e[i] (+ bias), x . up_e[i] (+ bias)) for pair p = t * k + j,
/// e = topk_ids[p], biases row e of b13 [num_experts, 2 * inter] (null: none),
/// x = hidden[t] (row stride hidden_stride), gate / up rows i and inter + i of w13[e]; ungated,
/// row i of w13[e] is the up row (b13 [num_experts, inter]); 0 for an id outside
/// [0, num_experts). Grid (num_pairs, ceil(inter / warps per block)), block a multiple of 32
/// threads. act: fp32 [num_pairs, inter].
template <typename T>
__global__ void moe_gate_up_kernel(const T* hidden, int64_t hidden_stride, const T* const* w13,
                                   const T* b13, const int64_t* topk_ids, int64_t k,
                                   int64_t num_experts, int64_t hidden_size, int64_t inter,
                                   MoeGate moe_gate, float* act) {
  const int lane = threadIdx.x % 32;
  const int64_t pair = blockIdx.x;
  const int64_t i = static_cast<int64_t>(blockIdx.y) * (blockDim.x / 32) + threadIdx.x / 32;
  if (i >= inter) return;  // whole warps leave together
  const int64_t e = topk_ids[pair];
  if (e < 0 || e >= num_experts) {
    if (lane == 0) act[pair * inter + i] = 0.0f;
    return;
  }
  const T* x = hidden + (pair / k) * hidden_stride;
  const T* gate_row = w13[e] + i * hidden_size;
  float gate = 0.0f, up = 0.0f;
  if (moe_gate.ungated) {
    for (int64_t c = lane; c < hidden_size; c += 32) up += to_float(x[c]) * to_float(gate_row[c]);
  } else {
    const T* up_row = gate_row + inter * hidden_size;
    for (int64_t c = lane; c < hidden_size; c += 32) {
      const float v = to_float(x[c]);
      gate += v * to_float(gate_row[c]);
      up += v * to_float(up_row[c]);
    }
  }
  gate = warp_sum(gate);
  up = warp_sum(up);
  if (lane == 0) {
    if (b13 && moe_gate.ungated) {
      up += to_float(b13[e * inter + i]);
    } else if (b13) {
      gate += to_float(b13[e * 2 * inter + i]);
      up += to_float(b13[e * 2 * inter + inter + i]);
    }
    act[pair * inter + i] = moe_gate(gate, up);
  }
}

/// out[t, c] = sum_j topk_weights[t, j] * (act[t * k + j] . down_e[c] (+ b2[e][c])),
/// e = topk_ids[t * k + j], down_e = w2[e], b2 [num_experts, hidden_size] (null: none), in
/// slot order j, skipping ids outside [0, num_experts). Grid (num_tokens,
/// ceil(hidden_size / warps per block)), block a multiple of 32 threads. out: [num_tokens,
/// hidden_size] contiguous.
template <typename T>
__global__ void moe_down_combine_kernel(const float* act, const T* const* w2,
                                        const T* b2, const int64_t* topk_ids, const float* topk_weights,
                                        int64_t k, int64_t num_experts, int64_t hidden_size,
                                        int64_t inter, T* out) {
  const int lane = threadIdx.x % 32;
  const int64_t t = blockIdx.x;
  const int64_t c = static_cast<int64_t>(blockIdx.y) * (blockDim.x / 32) + threadIdx.x / 32;
  if (c >= hidden_size) return;
  float acc = 0.0f;
  for (int64_t j = 0; j < k; ++j) {
    const int64_t pair = t * k + j, e = topk_ids[pair];
    if (e < 0 || e >= num_experts) continue;  // the same for every lane
    const float* a = act + pair * inter;
    const T* row = w2[e] + c * inter;
    float dot = 0.0f;
    for (int64_t i = lane; i < inter; i += 32) dot += a[i] * to_float(row[i]);
    const float bias = b2 ? to_float(b2[e * hidden_size + c]) : 0.0f;
    acc += topk_weights[pair] * (warp_sum(dot) + bias);
  }
  if (lane == 0) out[t * hidden_size + c] = from_float<T>(acc);
}

}  // namespace kvserve::cuda
