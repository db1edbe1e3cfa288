#pragma once
// The router of a mixture-of-experts layer: which experts each token runs through, and with what
// weights, from the router's logits.

#include <ATen/core/Tensor.h>

#include <optional>
#include <string_view>
#include <tuple>

namespace kvserve::ops {

/// Per token t (row of router_logits [T, num_experts], fp32 / bf16 / fp16, last dim contiguous):
///  1. scores = softmax(logits) (scoring_func "softmax") or sigmoid(logits) ("sigmoid"), in fp32;
///  2. choice = scores + correction_bias (fp32 [num_experts]; absent: + 0);
///  3. with n_group > 1: the experts form n_group equal groups of consecutive ids; a group ranks by
///     its best choice (softmax) or the sum of its best two (sigmoid), and only the topk_group best
///     groups stay candidates (DeepSeek-V2 group_limited_greedy; DeepSeek-V3 noaux_tc);
///  4. the top_k candidates by choice, best first; on equal choices the lower expert id (group id)
///     wins; a NaN choice loses to every number;
///  5. weight = score (without the bias) of each; renormalize: weights /= (their sum + 1e-20);
///     then weights *= routed_scaling_factor.
/// Returns (topk_weights fp32 [T, top_k], topk_ids int64 [T, top_k]), as fused_moe takes them.
/// Throws c10::Error on a bad shape, dtype, scoring_func, or a grouping that leaves fewer than
/// top_k candidates (topk_group * num_experts / n_group < top_k).
std::tuple<at::Tensor, at::Tensor> moe_routing(const at::Tensor& router_logits,
                                               const std::optional<at::Tensor>& correction_bias,
                                               int64_t top_k, std::string_view scoring_func,
                                               int64_t n_group, int64_t topk_group,
                                               bool renormalize, double routed_scaling_factor);

}  // namespace kvserve::ops
