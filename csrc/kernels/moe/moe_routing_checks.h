#pragma once
// Argument checks of moe_routing shared by its CPU and CUDA launchers.

#include <ATen/core/Tensor.h>

#include <optional>
#include <string_view>

#include "kernels/op_checks.h"

namespace kvserve::ops {

/// The logits' shape and dtype, the routing parameters, and correction_bias (when given:
/// contiguous fp32 [num_experts] on the logits' device); see moe_routing.h.
void check_moe_routing(const at::Tensor& router_logits,
                       const std::optional<at::Tensor>& correction_bias, int64_t top_k,
                       std::string_view scoring_func, int64_t n_group,
                       int64_t topk_group);

}  // namespace kvserve::ops
