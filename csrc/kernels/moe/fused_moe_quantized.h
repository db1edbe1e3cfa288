#pragma once
// fused_moe on weight-only quantized experts (int8, int4, fp8 E4M3): the routed experts of a
// mixture-of-experts MLP with each expert's projections stored as quantized_linear reads them.

#include <ATen/core/Tensor.h>

#include <string_view>

namespace kvserve::ops {

/// out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, j],
/// where an expert's projections are dequant(w13[e]) [2 * inter, hidden_size] (gate rows, then up
/// rows) and dequant(w2[e]) [hidden_size, inter]; with activation "relu2" (no gate, fused_moe.h)
/// down_e(relu(up_e(x_t))^2), w13[e] [inter, hidden_size] the up rows alone; each as
/// kernels/linear/quantized_linear.h
/// defines dequant: q int8 [n, k], packed int4 uint8 [n, k / 2] or float8_e4m3fn [n, k], with
/// scales fp32 or fp16 [n, k / group_size] and zeros of that shape and dtype or none.
/// hidden: [T, hidden_size] fp32, bf16 or fp16 (rows may be strided, last dim contiguous).
/// w13 / w13_scales / w13_zeros, w2 / w2_scales / w2_zeros: one per expert (a zeros list is
/// empty for none), every expert of one format and shape; w13_group_size divides hidden_size,
/// w2_group_size divides inter (multiples of 32 for int4).
/// topk_weights: fp32 [T, k]; topk_ids: int64 [T, k], each in [0, num_experts).
/// Tokens are grouped by expert as in fused_moe; each projection runs quantized_linear (a GEMV
/// that streams the packed weight once for a few tokens, dequantized blocks and a GEMM for more).
/// Returns [T, hidden_size] in hidden's dtype; the weighted sum is accumulated in fp32 in slot
/// order j. Throws c10::Error naming the argument on any shape, dtype, format or group size
/// outside this contract (activation: silu or relu2), or an expert id out of range, before any
/// expert runs.
at::Tensor fused_moe_quantized(const at::Tensor& hidden, at::TensorList w13,
                               at::TensorList w13_scales, at::TensorList w13_zeros,
                               int64_t w13_group_size, at::TensorList w2, at::TensorList w2_scales,
                               at::TensorList w2_zeros, int64_t w2_group_size,
                               const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                               std::string_view activation = "silu");

}  // namespace kvserve::ops
