#pragma once
// Argument checks that layer_norm's CPU and CUDA launchers share.

#include <ATen/core/Tensor.h>

#include <optional>

#include "kernels/op_checks.h"

namespace kvserve::ops {

/// Checks layer_norm's arguments (contract: layer_norm.h).
inline void check_layer_norm(const at::Tensor& out, const at::Tensor& input,
                             const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "layer_norm";
  check_norm_weight(op, input, weight);
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == input.scalar_type() || bias->scalar_type() == at::kFloat,
                op, ": bias must have input's dtype ", input.scalar_type(),
                " or be float32, got ", bias->scalar_type());
    TORCH_CHECK(bias->device() == input.device(), op, ": bias is on ", bias->device(),
                ", expected ", input.device());
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == input.size(1) && bias->is_contiguous(), op,
                ": bias must be contiguous [", input.size(1), "], got ", bias->sizes());
  }
  check_rows(op, "out", out, 2);
  check_like(op, "out", out, input);
  TORCH_CHECK(out.sizes() == input.sizes(), op, ": out must have the shape of input");
}

}  // namespace kvserve::ops
