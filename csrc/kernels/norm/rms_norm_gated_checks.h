#pragma once
// Argument checks that rms_norm_gated's CPU and CUDA launchers share.

#include <ATen/core/Tensor.h>

#include <optional>

#include "kernels/op_checks.h"

namespace kvserve::ops {

/// Checks rms_norm_gated's arguments (contract: rms_norm_gated.h).
inline void check_rms_norm_gated(const at::Tensor& out, const at::Tensor& input,
                                 const std::optional<at::Tensor>& gate,
                                 const std::optional<at::Tensor>& weight, int64_t group_size) {
  constexpr const char* op = "rms_norm_gated";
  check_rows(op, "input", input, 2);
  if (weight) {
    check_norm_weight(op, input, *weight);
  } else {
    TORCH_CHECK(gate.has_value(), op, ": without a weight (no norm) the gate is required");
  }
  check_rows(op, "out", out, 2);
  check_like(op, "out", out, input);
  TORCH_CHECK(out.sizes() == input.sizes(), op, ": out must have the shape of input");
  if (gate) {
    check_rows(op, "gate", *gate, 2);
    check_like(op, "gate", *gate, input);
    TORCH_CHECK(gate->sizes() == input.sizes(), op, ": gate must have the shape of input");
  }
  TORCH_CHECK(group_size >= 1 && input.size(1) % group_size == 0, op, ": group_size ",
              group_size, " must be positive and divide ", input.size(1));
}

}  // namespace kvserve::ops
