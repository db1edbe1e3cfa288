// CPU launcher for moe_routing: checks the router's logits and the routing parameters, then runs
// the per-capability body (one token per iteration, tokens split over the threads).
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>
#include <string_view>
#include <tuple>

#include "kernels/cpu_kernels.h"
#include "kernels/moe/moe_routing.h"
#include "kernels/op_checks.h"

namespace kvserve::ops {
namespace {

constexpr const char* kOp = "moe_routing";

std::tuple<at::Tensor, at::Tensor> moe_routing_cpu(const at::Tensor& router_logits,
                                                   const std::optional<at::Tensor>& correction_bias,
                                                   int64_t top_k, c10::string_view scoring_func,
                                                   int64_t n_group, int64_t topk_group,
                                                   bool renormalize, double routed_scaling_factor) {
  check_rows(kOp, "router_logits", router_logits, 2);
  const at::ScalarType dtype = router_logits.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, kOp,
              ": router_logits must be float32, bfloat16 or float16, got ", dtype);
  const int64_t num_tokens = router_logits.size(0), num_experts = router_logits.size(1);
  TORCH_CHECK(scoring_func == "softmax" || scoring_func == "sigmoid", kOp,
              ": scoring_func must be 'softmax' or 'sigmoid', got '", scoring_func, "'");
  TORCH_CHECK(num_experts > 0, kOp, ": router_logits has no experts");
  TORCH_CHECK(n_group >= 1 && num_experts % n_group == 0, kOp, ": n_group (", n_group,
              ") must be >= 1 and divide the ", num_experts, " experts");
  TORCH_CHECK(topk_group >= 1 && topk_group <= n_group, kOp, ": topk_group (", topk_group,
              ") must be in [1, n_group = ", n_group, "]");
  const int64_t per_group = num_experts / n_group;
  TORCH_CHECK(top_k >= 1 && top_k <= topk_group * per_group, kOp, ": top_k (", top_k,
              ") must be in [1, ", topk_group * per_group, "]: the ", topk_group, " best of ",
              n_group, " groups hold that many experts");
  const bool sigmoid = scoring_func == "sigmoid";
  TORCH_CHECK(!sigmoid || n_group == 1 || per_group >= 2, kOp,
              ": sigmoid group routing ranks a group by its best two experts; a group has ",
              per_group);
  const float* bias = nullptr;
  if (correction_bias.has_value() && correction_bias->defined()) {
    check_contiguous(kOp, "correction_bias", *correction_bias, at::kFloat);
    TORCH_CHECK(correction_bias->dim() == 1 && correction_bias->size(0) == num_experts, kOp,
                ": correction_bias must be [", num_experts, "], got ", correction_bias->sizes());
    TORCH_CHECK(correction_bias->device() == router_logits.device(), kOp,
                ": correction_bias is on ", correction_bias->device(), ", router_logits on ",
                router_logits.device());
    bias = correction_bias->data_ptr<float>();
  }
  at::Tensor weights = at::empty({num_tokens, top_k}, router_logits.options().dtype(at::kFloat));
  at::Tensor ids = at::empty({num_tokens, top_k}, router_logits.options().dtype(at::kLong));
  if (num_tokens == 0) return {weights, ids};
  cpu::MoERoutingArgs args{};
  args.dtype = dtype;
  args.logits = router_logits.data_ptr();
  args.logits_stride = router_logits.stride(0);
  args.bias = bias;
  args.num_tokens = num_tokens;
  args.num_experts = num_experts;
  args.top_k = top_k;
  args.sigmoid = sigmoid;
  args.n_group = n_group;
  args.topk_group = topk_group;
  args.renormalize = renormalize;
  args.routed_scaling_factor = static_cast<float>(routed_scaling_factor);
  args.weights = weights.data_ptr<float>();
  args.ids = ids.data_ptr<int64_t>();
  cpu::moe_routing_stub.get()(args);
  return {weights, ids};
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("moe_routing", &moe_routing_cpu); }

}  // namespace kvserve::ops
