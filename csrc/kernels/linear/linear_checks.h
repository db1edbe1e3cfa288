#pragma once
// Argument checks of linear shared by its CPU and CUDA launchers (the weight's device and layout
// are the launchers' own: the CPU also takes a packed weight).

#include <ATen/core/Tensor.h>

#include <optional>

#include "kernels/op_checks.h"

namespace kvserve::ops {

void check_linear(const at::Tensor& input, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias);

}  // namespace kvserve::ops
