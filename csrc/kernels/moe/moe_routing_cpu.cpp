// CPU launcher for moe_routing: checks the router's logits and the routing parameters, then runs
// the per-capability body (one token per iteration, tokens split over the threads).
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>
#include <string_view>
#include <tuple>

#include "kernels/cpu_kernels.h"
#include "kernels/moe/moe_routing.h"
#include "kernels/moe/moe_routing_checks.h"

namespace kvserve::ops {
namespace {

std::tuple<at::Tensor, at::Tensor> moe_routing_cpu(const at::Tensor& router_logits,
                                                   const std::optional<at::Tensor>& correction_bias,
                                                   int64_t top_k, c10::string_view scoring_func,
                                                   int64_t n_group, int64_t topk_group,
                                                   bool renormalize, double routed_scaling_factor) {
  check_moe_routing(router_logits, correction_bias, top_k, scoring_func, n_group, topk_group);
  const at::ScalarType dtype = router_logits.scalar_type();
  const int64_t num_tokens = router_logits.size(0), num_experts = router_logits.size(1);
  const bool has_bias = correction_bias.has_value() && correction_bias->defined();
  at::Tensor weights = at::empty({num_tokens, top_k}, router_logits.options().dtype(at::kFloat));
  at::Tensor ids = at::empty({num_tokens, top_k}, router_logits.options().dtype(at::kLong));
  if (num_tokens == 0) return {weights, ids};
  cpu::MoERoutingArgs args{};
  args.dtype = dtype;
  args.logits = router_logits.data_ptr();
  args.logits_stride = router_logits.stride(0);
  args.bias = has_bias ? correction_bias->data_ptr<float>() : nullptr;
  args.num_tokens = num_tokens;
  args.num_experts = num_experts;
  args.top_k = top_k;
  args.sigmoid = scoring_func == "sigmoid";
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
