#pragma once
// Argument checks of linear shared by its CPU and CUDA launchers (the weight's device and layout
// are the launchers' own: the CPU also takes a packed weight).

#include <ATen/core/Tensor.h>

#include <optional>

#include "kernels/op_checks.h"

namespace kvserve::ops {

inline void check_linear(const at::Tensor& input, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "linear";
  check_rows(op, "input", input, 2);
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == input.size(1), op, ": weight must be [out, ",
              input.size(1), "], got ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == input.scalar_type(), op,
              ": weight must have the input's dtype ", input.scalar_type(), ", got ",
              weight.scalar_type());
  const int64_t n = weight.size(0);
  if (bias) {
    check_like(op, "bias", *bias, input);
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous(), op,
                ": bias must be contiguous [", n, "]");
  }
}

}  // namespace kvserve::ops
