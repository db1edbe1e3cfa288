#pragma once
// CUDA body of fused_moe_quantized (contract: fused_moe_quantized.h) over quantized expert
// weights stacked per projection: q13 [num_experts, 2 * inter, row bytes] with scales / zeros
// [num_experts, 2 * inter, hidden_size / group], q2 [num_experts, hidden_size, row bytes] with
// [num_experts, hidden_size, inter / group]. The two passes of fused_moe's body (SwiGLU per
// (pair, intermediate unit), then down rows and the weighted sum per (token, output unit)),
// each weight dequantized in registers as it is read. fp32 accumulation. A plain baseline, like
// fused_moe's: no tiling through shared memory yet. Raw pointers only, no torch headers; the
// launcher checks shapes, dtypes, formats and expert ids.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "kernels/cuda_dtype.cuh"
#include "kernels/linear/quantized_linear_kernel.cuh"

namespace kvserve::cuda {

namespace moe_quantized_detail {

/// Bytes of one weight row of k inputs.
template <QuantFormat F>
__device__ inline int64_t row_bytes(int64_t k) {
  return F == QuantFormat::kInt4 ? k / 2 : k;
}

/// dequant(q)[row, i] for a weight of k inputs (quantized_linear.h: int4 in chunks of 32 inputs,
/// byte j of a chunk holding input j in its low nibble and j + 16 in its high one).
template <QuantFormat F>
__device__ inline float weight_at(const uint8_t* q, const float* scales, const float* zeros,
                                  int64_t row, int64_t i, int64_t k, int64_t group_size) {
  const uint8_t* r = q + row * row_bytes<F>(k);
  float v;
  if constexpr (F == QuantFormat::kInt4) {
    const int64_t j = i % 32;
    const uint8_t byte = r[(i / 32) * 16 + j % 16];
    v = static_cast<float>(j < 16 ? (byte & 0x0f) : (byte >> 4));
  } else if constexpr (F == QuantFormat::kInt8) {
    v = static_cast<float>(static_cast<int8_t>(r[i]));
  } else {
    __nv_fp8_e4m3 f;
    f.__x = r[i];
    v = static_cast<float>(f);
  }
  const int64_t g = row * (k / group_size) + i / group_size;
  return (v - (zeros != nullptr ? zeros[g] : 0.0f)) * scales[g];
}

/// x . dequant(q)[row] over k inputs.
template <QuantFormat F, typename X>
__device__ inline float dot(const X* x, const uint8_t* q, const float* scales, const float* zeros,
                            int64_t row, int64_t k, int64_t group_size) {
  float acc = 0.0f;
  for (int64_t i = 0; i < k; ++i) {
    acc += to_float(x[i]) * weight_at<F>(q, scales, zeros, row, i, k, group_size);
  }
  return acc;
}

}  // namespace moe_quantized_detail

/// act[p, i] = silu(x . gate_e[i]) * (x . up_e[i]) for pair p = t * k + j, e = topk_ids[p],
/// x = hidden[t], gate / up rows i and inter + i of expert e's dequantized w13. zeros13 nullable.
/// Grid (num_pairs, ceil(inter / blockDim.x)). act: fp32 [num_pairs, inter].
template <typename T, QuantFormat F>
__global__ void moe_quantized_gate_up_kernel(const T* hidden, int64_t hidden_stride,
                                             const uint8_t* q13, const float* scales13,
                                             const float* zeros13, const int64_t* topk_ids,
                                             int64_t k, int64_t hidden_size, int64_t inter,
                                             int64_t group_size, float* act) {
  namespace d = moe_quantized_detail;
  const int64_t pair = blockIdx.x;
  const int64_t i = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (i >= inter) return;
  const int64_t e = topk_ids[pair], groups = hidden_size / group_size;
  const uint8_t* q = q13 + e * 2 * inter * d::row_bytes<F>(hidden_size);
  const float* s = scales13 + e * 2 * inter * groups;
  const float* z = zeros13 != nullptr ? zeros13 + e * 2 * inter * groups : nullptr;
  const T* x = hidden + (pair / k) * hidden_stride;
  const float gate = d::dot<F>(x, q, s, z, i, hidden_size, group_size);
  const float up = d::dot<F>(x, q, s, z, inter + i, hidden_size, group_size);
  act[pair * inter + i] = gate / (1.0f + __expf(-gate)) * up;
}

/// out[t, c] = sum_j topk_weights[t, j] * (act[t * k + j] . down_e[c]), e = topk_ids[t * k + j],
/// down_e expert e's dequantized w2. zeros2 nullable. Grid (num_tokens, ceil(hidden_size /
/// blockDim.x)). out: [num_tokens, hidden_size] contiguous.
template <typename T, QuantFormat F>
__global__ void moe_quantized_down_combine_kernel(const float* act, const uint8_t* q2,
                                                  const float* scales2, const float* zeros2,
                                                  const int64_t* topk_ids,
                                                  const float* topk_weights, int64_t k,
                                                  int64_t hidden_size, int64_t inter,
                                                  int64_t group_size, T* out) {
  namespace d = moe_quantized_detail;
  const int64_t t = blockIdx.x;
  const int64_t c = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (c >= hidden_size) return;
  const int64_t groups = inter / group_size;
  float acc = 0.0f;
  for (int64_t j = 0; j < k; ++j) {
    const int64_t pair = t * k + j, e = topk_ids[pair];
    const uint8_t* q = q2 + e * hidden_size * d::row_bytes<F>(inter);
    const float* s = scales2 + e * hidden_size * groups;
    const float* z = zeros2 != nullptr ? zeros2 + e * hidden_size * groups : nullptr;
    acc += topk_weights[pair] * d::dot<F>(act + pair * inter, q, s, z, c, inter, group_size);
  }
  out[t * hidden_size + c] = from_float<T>(acc);
}

}  // namespace kvserve::cuda
