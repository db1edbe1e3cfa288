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
std::optional<at::Tensor> moe_quantized_zeros(at::TensorList zeros, int64_t e);

/// One tensor per expert, each contiguous with the dtype, shape and device of list[0].
void check_moe_quantized_list(const char* name, at::TensorList list, size_t num_experts);

/// Every argument of fused_moe_quantized.h but the ids' values; returns the formats of w13 and
/// w2. Expert 0's projections go through quantized_linear's checks (on an input of no tokens),
/// which then hold for every expert.
std::pair<cpu::QuantFormat, cpu::QuantFormat> check_fused_moe_quantized(
    const at::Tensor& hidden, at::TensorList w13, at::TensorList w13_scales,
    at::TensorList w13_zeros, int64_t w13_group_size, at::TensorList w2,
    at::TensorList w2_scales, at::TensorList w2_zeros, int64_t w2_group_size,
    const at::Tensor& topk_weights, const at::Tensor& topk_ids);

}  // namespace kvserve::ops
