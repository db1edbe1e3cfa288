#pragma once
// Argument checks of fused_moe_quantized shared by its CPU and CUDA launchers: every expert like
// expert 0, expert 0's projections by quantized_linear's checks, and the routing tensors.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <optional>
#include <utility>

#include "kernels/linear/quantized_linear_checks.h"
#include "kernels/moe/fused_moe_checks.h"
#include "kernels/op_checks.h"

namespace kvserve::ops {

/// Expert e's zeros of a projection: none when the list is empty.
inline std::optional<at::Tensor> moe_quantized_zeros(at::TensorList zeros, int64_t e) {
  return zeros.empty() ? std::nullopt : std::optional<at::Tensor>(zeros[e]);
}

/// One tensor per expert, each contiguous with the dtype, shape and device of list[0].
inline void check_moe_quantized_list(const char* name, at::TensorList list, size_t num_experts) {
  constexpr const char* op = "fused_moe_quantized";
  TORCH_CHECK(list.size() == num_experts, op, ": ", name, " needs one tensor per expert (",
              num_experts, "), got ", list.size());
  for (const at::Tensor& t : list) {
    TORCH_CHECK(t.scalar_type() == list[0].scalar_type() && t.sizes() == list[0].sizes() &&
                    t.is_contiguous(),
                op, ": every ", name, " must be contiguous with the dtype and shape of ", name,
                "[0] (", list[0].scalar_type(), " ", list[0].sizes(), "), got ", t.scalar_type(),
                " ", t.sizes());
    TORCH_CHECK(t.device() == list[0].device(), op, ": every ", name, " must be on ",
                list[0].device(), ", got ", t.device());
  }
}

/// The formats of w13 and w2, and the experts' intermediate size.
struct MoeQuantizedShape {
  cpu::QuantFormat format13, format2;
  int64_t inter;
};

/// Every argument of fused_moe_quantized.h but the ids' values (gated: silu; else relu2, w13 the
/// up rows alone). Expert 0's projections go through quantized_linear's checks (on an input of
/// no tokens), which then hold for every expert.
inline MoeQuantizedShape check_fused_moe_quantized(
    const at::Tensor& hidden, at::TensorList w13, at::TensorList w13_scales,
    at::TensorList w13_zeros, int64_t w13_group_size, at::TensorList w2,
    at::TensorList w2_scales, at::TensorList w2_zeros, int64_t w2_group_size,
    const at::Tensor& topk_weights, const at::Tensor& topk_ids, c10::string_view activation) {
  constexpr const char* op = "fused_moe_quantized";
  TORCH_CHECK(activation == "silu" || activation == "relu2", op,
              ": activation must be silu or relu2, got ", activation);
  const bool gated = activation == "silu";
  check_rows(op, "hidden", hidden, 2);
  const size_t num_experts = w13.size();
  TORCH_CHECK(num_experts > 0, op, ": needs at least one expert");
  for (auto [name, list] : {std::pair{"w13", w13}, {"w13_scales", w13_scales}, {"w2", w2},
                            {"w2_scales", w2_scales}}) {
    check_moe_quantized_list(name, list, num_experts);
  }
  if (!w13_zeros.empty()) check_moe_quantized_list("w13_zeros", w13_zeros, num_experts);
  if (!w2_zeros.empty()) check_moe_quantized_list("w2_zeros", w2_zeros, num_experts);
  TORCH_CHECK(w13[0].dim() == 2 && (!gated || w13[0].size(0) % 2 == 0), op, ": w13 must be [",
              gated ? "2 * inter" : "inter", ", packed hidden_size], got ", w13[0].sizes());
  const int64_t inter = gated ? w13[0].size(0) / 2 : w13[0].size(0);
  const auto check = [&](const char* name, const at::Tensor& x, at::TensorList q,
                         at::TensorList scales, at::TensorList zeros, int64_t group_size) {
    TORCH_CHECK(zeros.empty() || zeros[0].dim() == 2, op, ": ", name,
                "_zeros must be [n, groups] for each expert (a single shared zero is "
                "quantized_linear's only), got ", zeros[0].sizes());
    try {
      return check_quantized_linear(x, q[0], scales[0], moe_quantized_zeros(zeros, 0),
                                    group_size, std::nullopt);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, op, ": ", name, ": ", e.what_without_backtrace());
    }
  };
  const cpu::QuantFormat format13 = check("w13", hidden.narrow(0, 0, 0), w13, w13_scales,
                                          w13_zeros, w13_group_size);
  TORCH_CHECK(w2[0].dim() == 2 && w2[0].size(0) == hidden.size(1), op, ": w2 must have ",
              hidden.size(1), " rows (hidden_size), got ", w2[0].sizes());
  const cpu::QuantFormat format2 = check("w2", at::empty({0, inter}, hidden.options()), w2,
                                         w2_scales, w2_zeros, w2_group_size);
  check_moe_topk(op, hidden, topk_weights, topk_ids);
  return {format13, format2, inter};
}

}  // namespace kvserve::ops
