#pragma once
// Argument checks of moe_routing shared by its CPU and CUDA launchers.

#include <ATen/core/Tensor.h>

#include <optional>
#include <string_view>

#include "kernels/op_checks.h"

namespace kvserve::ops {

/// The logits' shape and dtype, the routing parameters, and correction_bias (when given:
/// contiguous fp32 [num_experts] on the logits' device); see moe_routing.h.
inline void check_moe_routing(const at::Tensor& router_logits,
                              const std::optional<at::Tensor>& correction_bias, int64_t top_k,
                              std::string_view scoring_func, int64_t n_group,
                              int64_t topk_group) {
  constexpr const char* op = "moe_routing";
  check_rows(op, "router_logits", router_logits, 2);
  const at::ScalarType dtype = router_logits.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op,
              ": router_logits must be float32, bfloat16 or float16, got ", dtype);
  const int64_t num_experts = router_logits.size(1);
  TORCH_CHECK(scoring_func == "softmax" || scoring_func == "sigmoid", op,
              ": scoring_func must be 'softmax' or 'sigmoid', got '", scoring_func, "'");
  TORCH_CHECK(num_experts > 0, op, ": router_logits has no experts");
  TORCH_CHECK(n_group >= 1 && num_experts % n_group == 0, op, ": n_group (", n_group,
              ") must be >= 1 and divide the ", num_experts, " experts");
  TORCH_CHECK(topk_group >= 1 && topk_group <= n_group, op, ": topk_group (", topk_group,
              ") must be in [1, n_group = ", n_group, "]");
  const int64_t per_group = num_experts / n_group;
  TORCH_CHECK(top_k >= 1 && top_k <= topk_group * per_group, op, ": top_k (", top_k,
              ") must be in [1, ", topk_group * per_group, "]: the ", topk_group, " best of ",
              n_group, " groups hold that many experts");
  TORCH_CHECK(scoring_func != "sigmoid" || n_group == 1 || per_group >= 2, op,
              ": sigmoid group routing ranks a group by its best two experts; a group has ",
              per_group);
  if (correction_bias.has_value() && correction_bias->defined()) {
    check_contiguous(op, "correction_bias", *correction_bias, at::kFloat);
    TORCH_CHECK(correction_bias->dim() == 1 && correction_bias->size(0) == num_experts, op,
                ": correction_bias must be [", num_experts, "], got ", correction_bias->sizes());
    TORCH_CHECK(correction_bias->device() == router_logits.device(), op,
                ": correction_bias is on ", correction_bias->device(), ", router_logits on ",
                router_logits.device());
  }
}

}  // namespace kvserve::ops
