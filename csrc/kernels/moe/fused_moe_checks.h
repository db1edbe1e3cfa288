#pragma once
// Argument checks of fused_moe shared by its CPU and CUDA launchers, and the routing tensors'
// checks that fused_moe_quantized shares too. Shapes, dtypes and devices only: expert ids are
// checked where the host holds them (routed_experts_cpu); the CUDA bodies skip a bad one.

#include <ATen/core/Tensor.h>

#include <optional>

#include "kernels/op_checks.h"

namespace kvserve::ops {

/// topk_weights fp32 and topk_ids int64, both contiguous [hidden.size(0), k] on hidden's device.
inline void check_moe_topk(const char* op, const at::Tensor& hidden,
                           const at::Tensor& topk_weights, const at::Tensor& topk_ids) {
  check_contiguous(op, "topk_weights", topk_weights, at::kFloat);
  check_contiguous(op, "topk_ids", topk_ids, at::kLong);
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == hidden.size(0) &&
                  topk_weights.sizes() == topk_ids.sizes(),
              op, ": topk_weights and topk_ids must both be [", hidden.size(0), ", k], got ",
              topk_weights.sizes(), " and ", topk_ids.sizes());
  TORCH_CHECK(topk_weights.device() == hidden.device() && topk_ids.device() == hidden.device(),
              op, ": topk_weights and topk_ids must be on hidden's device ", hidden.device());
}

/// Every weight of `weights` is [rows, cols] of hidden's dtype, on hidden's device.
inline void check_moe_experts(const char* name, at::TensorList weights, int64_t rows,
                              int64_t cols, const at::Tensor& hidden) {
  constexpr const char* op = "fused_moe";
  for (const at::Tensor& w : weights) {
    TORCH_CHECK(w.dim() == 2 && w.size(0) == rows && w.size(1) == cols, op, ": every ", name,
                " must be [", rows, ", ", cols, "], got ", w.sizes());
    TORCH_CHECK(w.scalar_type() == hidden.scalar_type(), op, ": ", name,
                " must have hidden's dtype ", hidden.scalar_type(), ", got ", w.scalar_type());
    TORCH_CHECK(w.device() == hidden.device(), op, ": ", name, " is on ", w.device(),
                ", hidden on ", hidden.device());
  }
}

/// An expert projection's biases: none, or contiguous [experts, rows] of hidden's dtype and
/// device.
inline void check_moe_biases(const char* name, const std::optional<at::Tensor>& bias,
                             int64_t experts, int64_t rows, const at::Tensor& hidden) {
  constexpr const char* op = "fused_moe";
  if (!bias) return;
  TORCH_CHECK(bias->dim() == 2 && bias->size(0) == experts && bias->size(1) == rows &&
                  bias->is_contiguous(),
              op, ": ", name, " must be contiguous [num_experts = ", experts, ", ", rows,
              "], got ", bias->sizes());
  TORCH_CHECK(bias->scalar_type() == hidden.scalar_type() && bias->device() == hidden.device(),
              op, ": ", name, " must have hidden's dtype and device");
}

/// The experts' activation: gated, "silu" or "clamped_swiglu" with positive alpha and limit
/// (w13 holds gate rows then up rows), or "relu2" without a gate (w13 the up rows alone,
/// relu(up)^2: Nemotron-H's experts). Returns whether it is gated.
inline bool check_moe_activation(const char* op, c10::string_view activation, double alpha,
                                 double limit) {
  TORCH_CHECK(activation == "silu" || activation == "clamped_swiglu" || activation == "relu2",
              op, ": activation must be silu, clamped_swiglu or relu2, got ", activation);
  TORCH_CHECK(activation != "clamped_swiglu" || (alpha > 0 && limit > 0), op,
              ": clamped_swiglu needs positive alpha and limit, got ", alpha, " and ", limit);
  return activation != "relu2";
}

/// hidden [T, hidden_size] (last dim contiguous), one w13 [2 * inter, hidden_size] (gated; [inter,
/// hidden_size] without a gate) and one w2 [hidden_size, inter] per expert, and the routing
/// tensors (see fused_moe.h). Returns inter.
inline int64_t check_fused_moe(const at::Tensor& hidden, at::TensorList w13, at::TensorList w2,
                               const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                               const std::optional<at::Tensor>& w13_bias = std::nullopt,
                               const std::optional<at::Tensor>& w2_bias = std::nullopt,
                               bool gated = true) {
  constexpr const char* op = "fused_moe";
  check_rows(op, "hidden", hidden, 2);
  TORCH_CHECK(!w13.empty() && w2.size() == w13.size(), op,
              ": need one w13 and one w2 per expert, got ", w13.size(), " and ", w2.size());
  const int64_t rows = w13[0].size(0);
  TORCH_CHECK(w13[0].dim() == 2 && (!gated || rows % 2 == 0), op, ": w13 must be [",
              gated ? "2 * inter" : "inter", ", hidden_size], got ", w13[0].sizes());
  const int64_t inter = gated ? rows / 2 : rows;
  check_moe_experts("w13", w13, rows, hidden.size(1), hidden);
  check_moe_experts("w2", w2, hidden.size(1), inter, hidden);
  check_moe_biases("w13_bias", w13_bias, static_cast<int64_t>(w13.size()), rows, hidden);
  check_moe_biases("w2_bias", w2_bias, static_cast<int64_t>(w13.size()), hidden.size(1), hidden);
  check_moe_topk(op, hidden, topk_weights, topk_ids);
  return inter;
}

}  // namespace kvserve::ops
