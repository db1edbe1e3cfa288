#pragma once
// Argument checks of llm_int8_linear shared by its CPU and CUDA launchers.

#include <ATen/core/Tensor.h>

#include <cmath>
#include <optional>

#include "kernels/op_checks.h"

namespace kvserve::ops {

/// Every shape, dtype and device of llm_int8_linear.h, and a threshold that is a number.
inline void check_llm_int8_linear(const at::Tensor& input, const at::Tensor& weight,
                                  const at::Tensor& weight_scales, double threshold,
                                  const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "llm_int8_linear";
  check_rows(op, "input", input, 2);
  const at::ScalarType dtype = input.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op,
              ": input must be fp32, bf16 or fp16, got ", dtype);
  check_contiguous(op, "weight", weight, at::kChar);
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == input.size(1), op, ": weight must be [n, ",
              input.size(1), "], got ", weight.sizes());
  const int64_t n = weight.size(0), k = weight.size(1);
  check_contiguous(op, "weight_scales", weight_scales, at::kFloat);
  TORCH_CHECK(weight_scales.dim() == 1 && weight_scales.size(0) == n, op,
              ": weight_scales must be [", n, "], got ", weight_scales.sizes());
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == dtype && bias->dim() == 1 && bias->size(0) == n, op,
                ": bias must be [", n, "] of the input dtype");
  }
  TORCH_CHECK(weight.device() == input.device() && weight_scales.device() == input.device() &&
                  (!bias || bias->device() == input.device()),
              op, ": weight, weight_scales and bias must be on the input's device");
  TORCH_CHECK(k < (1 << 17), op, ": in_features ", k, " would overflow the int32 sums");
  TORCH_CHECK(!std::isnan(threshold), op, ": threshold is NaN");
}

}  // namespace kvserve::ops
