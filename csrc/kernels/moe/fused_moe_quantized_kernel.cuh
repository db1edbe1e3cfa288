#pragma once
// CUDA body of fused_moe_quantized (contract: fused_moe_quantized.h) over quantized expert
// weights reached through device arrays of pointers, one entry per expert: q13[e] [2 * inter,
// row bytes of hidden_size] with scales13[e] / zeros13[e] P13 (fp32 or fp16) [2 * inter,
// hidden_size / group],
// q2[e] [hidden_size, row bytes of inter] with scales2[e] / zeros2[e] [hidden_size, inter /
// group]; a zeros entry may be null (none). The two passes of fused_moe's body (SwiGLU per
// (pair, intermediate unit), then down rows and the weighted sum per (token, output unit)), one
// warp per output reading its weight row by 16-byte vectors (4-byte words where the data is not
// aligned for them) and dequantizing in registers as quantized_linear's GEMV does. fp32
// accumulation. A plain baseline, like fused_moe's: no grouping by expert and no tiling yet. An expert id outside [0, num_experts) contributes nothing
// (the launcher cannot check ids on the device without synchronising). Raw pointers only, no
// torch headers; the launcher checks shapes, dtypes and formats.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "kernels/cuda_dtype.cuh"
#include "kernels/cuda_reduce.cuh"
#include "kernels/linear/quantized_linear_kernel.cuh"

namespace kvserve::cuda {

/// act[p, i] = silu(x . gate_e[i]) * (x . up_e[i]) for pair p = t * k + j, e = topk_ids[p],
/// x = hidden[t], gate / up rows i and inter + i of expert e's dequantized w13; without a gate
/// (gated false: relu2), relu(x . up_e[i])^2 with up row i; 0 for a bad id.
/// Grid (num_pairs, ceil(inter / warps per block)), block a multiple of 32 threads. act: fp32
/// [num_pairs, inter]. aligned13: every q13[e] starts at a multiple of 4 and its rows are whole
/// words; vector13: the rows are read by 16-byte vectors (vector_gemv_applies to every q13[e]
/// and to hidden's rows).
template <typename T, QuantFormat F, typename P>
__global__ void moe_quantized_gate_up_kernel(const T* hidden, int64_t hidden_stride,
                                             const uint8_t* const* q13,
                                             const P* const* scales13,
                                             const P* const* zeros13, bool aligned13,
                                             bool vector13,
                                             const int64_t* topk_ids, int64_t k,
                                             int64_t num_experts, int64_t hidden_size,
                                             int64_t inter, int64_t group_size, bool gated,
                                             float* act) {
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
  float gate = 0.0f, up = 0.0f;
  // Row `row` of the expert's w13 dotted with x, into *sum.
  const auto dot = [&](int64_t row, float* sum) {
    if (vector13) {
      quantized_row_dot_vectors<F>(x, q13[e], scales13[e], zeros13[e], row, hidden_size,
                                   group_size, lane, sum);
    } else {
      quantized_row_dot<F, 1>(x, 0, 1, q13[e], scales13[e], zeros13[e], row, hidden_size,
                              group_size, aligned13, lane, sum);
    }
  };
  if (gated) {
    dot(i, &gate);
    dot(inter + i, &up);
  } else {
    dot(i, &up);
  }
  gate = warp_sum(gate);
  up = warp_sum(up);
  if (lane == 0) {
    act[pair * inter + i] = gated ? gate / (1.0f + __expf(-gate)) * up
                                  : (up > 0.0f ? up * up : 0.0f);
  }
}

/// out[t, c] = sum_j topk_weights[t, j] * (act[t * k + j] . down_e[c]), e = topk_ids[t * k + j],
/// down_e expert e's dequantized w2, in slot order j, skipping bad ids. Grid (num_tokens,
/// ceil(hidden_size / warps per block)), block a multiple of 32 threads. out: [num_tokens,
/// hidden_size] contiguous. aligned2 and vector2 as aligned13 and vector13, for q2 and act.
template <typename T, QuantFormat F, typename P>
__global__ void moe_quantized_down_combine_kernel(const float* act, const uint8_t* const* q2,
                                                  const P* const* scales2,
                                                  const P* const* zeros2, bool aligned2,
                                                  bool vector2,
                                                  const int64_t* topk_ids,
                                                  const float* topk_weights, int64_t k,
                                                  int64_t num_experts, int64_t hidden_size,
                                                  int64_t inter, int64_t group_size, T* out) {
  const int lane = threadIdx.x % 32;
  const int64_t t = blockIdx.x;
  const int64_t c = static_cast<int64_t>(blockIdx.y) * (blockDim.x / 32) + threadIdx.x / 32;
  if (c >= hidden_size) return;
  float acc = 0.0f;
  for (int64_t j = 0; j < k; ++j) {
    const int64_t pair = t * k + j, e = topk_ids[pair];
    if (e < 0 || e >= num_experts) continue;  // the same for every lane
    float dot = 0.0f;
    if (vector2) {
      quantized_row_dot_vectors<F>(act + pair * inter, q2[e], scales2[e], zeros2[e], c, inter,
                                   group_size, lane, &dot);
    } else {
      quantized_row_dot<F, 1>(act + pair * inter, 0, 1, q2[e], scales2[e], zeros2[e], c, inter,
                              group_size, aligned2, lane, &dot);
    }
    acc += topk_weights[pair] * warp_sum(dot);
  }
  if (lane == 0) out[t * hidden_size + c] = from_float<T>(acc);
}

}  // namespace kvserve::cuda
