#pragma once
// Argument checks of llm_int8_linear shared by its CPU and CUDA launchers.

#include <ATen/core/Tensor.h>

#include <cmath>
#include <optional>

#include "kernels/op_checks.h"

namespace kvserve::ops {

/// Every shape, dtype and device of llm_int8_linear.h, and a threshold that is a number.
void check_llm_int8_linear(const at::Tensor& input, const at::Tensor& weight,
                           const at::Tensor& weight_scales, double threshold,
                           const std::optional<at::Tensor>& bias);

}  // namespace kvserve::ops
