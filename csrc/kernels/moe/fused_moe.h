#pragma once
// The routed experts of a mixture-of-experts MLP: every token runs through the experts its router
// chose, and their outputs are summed with the routing weights.

#include <ATen/core/Tensor.h>

#include <optional>
#include <string_view>

namespace kvserve::ops {

/// out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, j];
/// with activation "clamped_swiglu" (gpt-oss) the gate is clamped_swiglu_and_mul's with `alpha`
/// and `limit` instead of silu(gate) * up; with "relu2" (Nemotron-H) there is no gate:
/// down_e(relu(up_e(x_t))^2), w13 holding the up rows alone.
/// Tokens are grouped by expert, so each active expert runs one GEMM (one GEMV for a few tokens)
/// per projection over all of its tokens; experts run in parallel when each has few tokens.
/// hidden: [T, hidden_size] (rows may be strided, last dim contiguous).
/// w13: one weight per expert [2 * inter, hidden_size] (gate rows, then up rows; relu2: [inter,
///   hidden_size]); w2: one per expert [hidden_size, inter]; each plain or packed by
///   linear_prepack, in hidden's dtype.
/// w13_bias / w2_bias: absent, or every expert's bias [num_experts, w13 rows] /
///   [num_experts, hidden_size], contiguous, in hidden's dtype, added to that projection's output
///   (gpt-oss).
/// topk_weights: fp32 [T, k]; topk_ids: int64 [T, k], each in [0, num_experts).
/// Returns [T, hidden_size] in hidden's dtype; the weighted sum is accumulated in fp32 in slot
/// order j. The activation runs in hidden's dtype on the CPU (the reference's rounding), in fp32
/// on CUDA. Throws c10::Error on mismatched shapes or dtypes, an unknown activation, or an
/// expert id out of range.
at::Tensor fused_moe(const at::Tensor& hidden, at::TensorList w13, at::TensorList w2,
                     const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                     const std::optional<at::Tensor>& w13_bias = std::nullopt,
                     const std::optional<at::Tensor>& w2_bias = std::nullopt,
                     std::string_view activation = "silu", double alpha = 1.702,
                     double limit = 7.0);

}  // namespace kvserve::ops
