#include "layers/moe.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/stack.h>

#include <stdexcept>

#include "kernels/linear/linear.h"
#include "kernels/moe/fused_moe.h"
#include "kernels/moe/fused_moe_quantized.h"
#include "kernels/moe/moe_routing.h"

namespace kvserve {
namespace {

// One expert's weight as fused_moe reads it: packed where the device's GEMM has a packed layout.
at::Tensor prepared(const at::Tensor& weight) {
  at::Tensor plain = weight.contiguous();
  at::Tensor packed = ops::linear_prepack(plain);
  return packed.defined() ? packed : plain;
}

// The tensors of one field of every expert's quantized projection (an empty list for absent
// zeros), as fused_moe_quantized takes them.
std::vector<at::Tensor> field(const std::vector<QuantizedLinearWeight>& experts,
                              at::Tensor QuantizedLinearWeight::*member) {
  std::vector<at::Tensor> out;
  for (const QuantizedLinearWeight& q : experts) {
    if ((q.*member).defined()) out.push_back(q.*member);
  }
  return out;
}

}  // namespace

SparseMoE::SparseMoE(const MoEConfig& c, const std::string& p, const WeightMap& w) : config_(c) {
  router_ = w.get(p + "gate.weight");
  TORCH_CHECK(router_.dim() == 2 && router_.size(0) == c.num_experts, p,
              "gate.weight must be [num_experts, hidden], got ", router_.sizes());
  if (c.fp32_router) router_ = router_.to(at::kFloat);
  if (c.router_bias) router_bias_ = w.get(p + "gate.bias").to(router_.scalar_type());
  if (c.scoring_func == "sigmoid") {
    score_bias_ = w.get(p + "gate.e_score_correction_bias").to(at::kFloat);
  }
  route_logits(at::empty({0, c.num_experts}, router_.options().dtype(at::kFloat)));  // checks c
  // Experts without a gate (relu2) hold their up projection alone where gate_up would be.
  const std::string w13 = c.activation == "relu2" ? "up_proj" : "gate_up_proj";
  const bool quantized = w.get_optional(p + "experts.0." + w13 + ".qweight").defined();
  std::vector<at::Tensor> biases13, biases2;
  if (quantized && (c.expert_bias || c.activation == "clamped_swiglu")) {
    throw std::invalid_argument(p + "experts: quantized experts run SwiGLU or relu2 without "
                                "biases only");
  }
  for (int64_t e = 0; e < c.num_experts; ++e) {
    const std::string expert = p + "experts." + std::to_string(e) + ".";
    if (quantized) {
      // Routed experts run weight-only (fused_moe_quantized): LLM.int8() weights as int8.
      w13_quantized_.push_back(
          QuantizedLinearWeight::load(w, expert + w13, /*weight_only=*/true));
      w2_quantized_.push_back(
          QuantizedLinearWeight::load(w, expert + "down_proj", /*weight_only=*/true));
    } else {
      w13_.push_back(prepared(w.get(expert + w13 + ".weight")));
      w2_.push_back(prepared(w.get(expert + "down_proj.weight")));
      if (c.expert_bias) {
        biases13.push_back(w.get(expert + w13 + ".bias"));
        biases2.push_back(w.get(expert + "down_proj.bias"));
      }
    }
  }
  if (c.expert_bias) {
    w13_bias_ = at::stack(biases13).contiguous();
    w2_bias_ = at::stack(biases2).contiguous();
  }
  if (c.latent_size > 0) {
    latent_in_ = Linear::load(w, p + "fc1_latent_proj");
    latent_out_ = Linear::load(w, p + "fc2_latent_proj");
    TORCH_CHECK(latent_in_.out_features() == c.latent_size &&
                    latent_out_.in_features() == c.latent_size &&
                    latent_out_.out_features() == latent_in_.in_features(),
                p, "fc1_latent_proj / fc2_latent_proj must be [", c.latent_size,
                ", hidden] / [hidden, ", c.latent_size, "]");
  }
  if (c.shared_intermediate_size > 0 && c.activation == "relu2") {
    shared_ = std::make_unique<UngatedMLP>(p + "shared_experts.", w, "relu2");
  } else if (c.shared_intermediate_size > 0) {
    shared_ = std::make_unique<GatedMLP>(p + "shared_experts.", w, "silu", /*partial=*/true);
  }
  if (w.communicator()->size() > 1) reduce_ = w.communicator();
}

std::pair<at::Tensor, at::Tensor> SparseMoE::route(const at::Tensor& x) const {
  const MoEConfig& c = config_;
  // DeepSeek's router multiplies in fp32; Mixtral's and Qwen's in the model's dtype.
  const std::optional<at::Tensor> bias =
      router_bias_.defined() ? std::optional<at::Tensor>(router_bias_) : std::nullopt;
  const at::Tensor logits = c.fp32_router ? at::linear(x.to(at::kFloat), router_, bias)
                                          : at::linear(x, router_, bias);  // [T, num_experts]
  return route_logits(logits);
}

std::pair<at::Tensor, at::Tensor> SparseMoE::route_logits(const at::Tensor& logits) const {
  const MoEConfig& c = config_;
  auto [weights, ids] = ops::moe_routing(
      logits, score_bias_.defined() ? std::optional<at::Tensor>(score_bias_) : std::nullopt,
      c.num_experts_per_tok, c.scoring_func, c.n_group, c.topk_group, c.norm_topk_prob,
      c.routed_scaling_factor);
  return {weights, ids};
}

at::Tensor SparseMoE::forward(const at::Tensor& x, const at::Tensor& /*lora_slots*/) const {
  auto [weights, ids] = route(x);
  // The routed experts' input: the hidden state, or its latent projection (Nemotron-H).
  const at::Tensor in = latent_in_.defined() ? latent_in_.forward(x) : x;
  at::Tensor out;
  if (w13_quantized_.empty()) {
    const auto bias = [](const at::Tensor& b) {
      return b.defined() ? std::optional<at::Tensor>(b) : std::nullopt;
    };
    out = ops::fused_moe(in, w13_, w2_, weights, ids, bias(w13_bias_), bias(w2_bias_),
                         config_.activation, config_.swiglu_alpha, config_.swiglu_limit);
  } else {
    using Q = QuantizedLinearWeight;
    const auto& a = w13_quantized_;
    const auto& b = w2_quantized_;
    out = ops::fused_moe_quantized(in, field(a, &Q::qweight), field(a, &Q::scales),
                                   field(a, &Q::zeros), a[0].group_size, field(b, &Q::qweight),
                                   field(b, &Q::scales), field(b, &Q::zeros), b[0].group_size,
                                   weights, ids, config_.activation);
  }
  if (latent_out_.defined()) out = latent_out_.forward(out);
  if (shared_) out.add_(shared_->forward(x, at::Tensor()));
  if (reduce_) reduce_->all_reduce_(out);  // the experts' and the shared expert's partial sums
  return out;
}

int64_t SparseMoE::weight_bytes() const {
  int64_t bytes_of_biases = 0;
  for (const at::Tensor* t : {&w13_bias_, &w2_bias_}) {
    if (t->defined()) bytes_of_biases += static_cast<int64_t>(t->nbytes());
  }
  int64_t bytes = bytes_of_biases + static_cast<int64_t>(router_.nbytes()) +
                  (router_bias_.defined() ? static_cast<int64_t>(router_bias_.nbytes()) : 0) +
                  (score_bias_.defined() ? static_cast<int64_t>(score_bias_.nbytes()) : 0);
  for (const auto* list : {&w13_, &w2_}) {
    for (const at::Tensor& t : *list) bytes += ops::linear_weight_nbytes(t);
  }
  for (const auto* list : {&w13_quantized_, &w2_quantized_}) {
    for (const QuantizedLinearWeight& q : *list) bytes += q.nbytes();
  }
  if (latent_in_.defined()) bytes += latent_in_.weight_bytes() + latent_out_.weight_bytes();
  return bytes + (shared_ ? shared_->weight_bytes() : 0);
}

}  // namespace kvserve
