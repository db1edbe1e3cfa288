#include "layers/moe.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/zeros_like.h>

#include <limits>

#include "kernels/linear/linear.h"
#include "kernels/moe/fused_moe.h"

namespace kvserve {
namespace {

// One expert's weight as fused_moe reads it: packed where the device's GEMM has a packed layout.
at::Tensor prepared(const at::Tensor& weight) {
  at::Tensor plain = weight.contiguous();
  at::Tensor packed = ops::linear_prepack(plain);
  return packed.defined() ? packed : plain;
}

}  // namespace

SparseMoE::SparseMoE(const MoEConfig& c, const std::string& p, const WeightMap& w) : config_(c) {
  router_ = w.get(p + "gate.weight");
  TORCH_CHECK(router_.dim() == 2 && router_.size(0) == c.num_experts, p,
              "gate.weight must be [num_experts, hidden], got ", router_.sizes());
  if (c.fp32_router) router_ = router_.to(at::kFloat);
  if (c.scoring_func == "sigmoid") {
    score_bias_ = w.get(p + "gate.e_score_correction_bias").to(at::kFloat);
    TORCH_CHECK(c.n_group == 1 || c.num_experts / c.n_group >= 2, p,
                ": sigmoid group routing ranks groups by their top two experts; a group has ",
                c.num_experts / c.n_group);
  }
  for (int64_t e = 0; e < c.num_experts; ++e) {
    const std::string expert = p + "experts." + std::to_string(e) + ".";
    w13_.push_back(prepared(w.get(expert + "gate_up_proj.weight")));
    w2_.push_back(prepared(w.get(expert + "down_proj.weight")));
  }
  if (c.shared_intermediate_size > 0) {
    shared_ = std::make_unique<GatedMLP>(p + "shared_experts.", w);
  }
}

std::pair<at::Tensor, at::Tensor> SparseMoE::route(const at::Tensor& x) const {
  const MoEConfig& c = config_;
  const bool sigmoid = c.scoring_func == "sigmoid";
  const at::Tensor logits = c.fp32_router ? at::linear(x.to(at::kFloat), router_)
                                          : at::linear(x, router_).to(at::kFloat);  // [T, E]
  const at::Tensor scores = sigmoid ? logits.sigmoid() : logits.softmax(-1);
  at::Tensor choice = score_bias_.defined() ? scores + score_bias_ : scores;
  if (c.n_group > 1) {
    // Only the topk_group best groups compete: a group ranks by its best expert (V2) or by the
    // sum of its best two (V3).
    const int64_t tokens = x.size(0), per_group = c.num_experts / c.n_group;
    const at::Tensor grouped = choice.view({tokens, c.n_group, per_group});
    const at::Tensor group_scores = sigmoid ? std::get<0>(grouped.topk(2, -1)).sum(-1)
                                            : std::get<0>(grouped.max(-1));
    const at::Tensor best = std::get<1>(group_scores.topk(c.topk_group, -1, true, false));
    const at::Tensor keep = at::zeros_like(group_scores)
                                .scatter_(1, best, 1.0)
                                .unsqueeze(-1)
                                .expand({tokens, c.n_group, per_group})
                                .reshape({tokens, c.num_experts});
    choice = choice.masked_fill(keep == 0,
                                sigmoid ? -std::numeric_limits<float>::infinity() : 0.0);
  }
  auto [top, ids] = choice.topk(c.num_experts_per_tok, -1, true, false);
  // Sigmoid routing chooses with the correction bias but weighs by the plain scores.
  at::Tensor weights = sigmoid ? scores.gather(1, ids) : top;
  if (c.norm_topk_prob) weights = weights / (weights.sum(-1, true) + (sigmoid ? 1e-20 : 0.0));
  if (c.routed_scaling_factor != 1.0) weights = weights * c.routed_scaling_factor;
  return {weights.contiguous(), ids.contiguous()};
}

at::Tensor SparseMoE::forward(const at::Tensor& x) const {
  auto [weights, ids] = route(x);
  at::Tensor out = ops::fused_moe(x, w13_, w2_, weights, ids);
  if (shared_) out.add_(shared_->forward(x));
  return out;
}

int64_t SparseMoE::weight_bytes() const {
  int64_t bytes = static_cast<int64_t>(router_.nbytes()) +
                  (score_bias_.defined() ? static_cast<int64_t>(score_bias_.nbytes()) : 0);
  for (const auto* list : {&w13_, &w2_}) {
    for (const at::Tensor& t : *list) bytes += ops::linear_weight_nbytes(t);
  }
  return bytes + (shared_ ? shared_->weight_bytes() : 0);
}

}  // namespace kvserve
