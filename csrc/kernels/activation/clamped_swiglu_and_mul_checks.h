#pragma once
// Argument checks that clamped_swiglu_and_mul's CPU and CUDA launchers share.

#include <ATen/core/Tensor.h>

#include "kernels/op_checks.h"

namespace kvserve::ops {

/// Checks clamped_swiglu_and_mul's arguments (contract: clamped_swiglu_and_mul.h).
inline void check_clamped_swiglu_and_mul(const at::Tensor& out, const at::Tensor& input,
                                         double alpha, double limit) {
  check_gated_activation("clamped_swiglu_and_mul", out, input);
  TORCH_CHECK(alpha > 0 && limit > 0, "clamped_swiglu_and_mul: alpha and limit must be "
              "positive, got ", alpha, " and ", limit);
}

}  // namespace kvserve::ops
