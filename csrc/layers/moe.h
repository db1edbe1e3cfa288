#pragma once
// Mixture-of-experts MLP: a router picks num_experts_per_tok of num_experts gated MLPs per token
// (softmax top-k as Mixtral and Qwen3-MoE; DeepSeek-V2's group-limited greedy; DeepSeek-V3's
// sigmoid scores with a correction bias and group top-2 sums), fused_moe runs them, and
// DeepSeek's shared experts add a dense MLP that every token takes. Nemotron-H's experts have no
// gate (relu(up)^2) and may run in a latent space between two projections.

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "kvserve/model_config.h"
#include "layers/feed_forward.h"
#include "layers/linear.h"
#include "layers/mlp.h"
#include "layers/weights.h"

namespace kvserve {

/// Weights (loader names, under `prefix`): gate.weight [num_experts, hidden] (the router), with
/// config.router_bias gate.bias [num_experts],
/// gate.e_score_correction_bias [num_experts] (sigmoid scoring only),
/// experts.<e>.gate_up_proj.weight [2 * moe_intermediate, hidden] and
/// experts.<e>.down_proj.weight [hidden, moe_intermediate] per expert (activation relu2:
/// experts.<e>.up_proj.weight [moe_intermediate, hidden] in place of gate_up; with
/// config.latent_size, latent in place of hidden, and fc1_latent_proj [latent, hidden] and
/// fc2_latent_proj [hidden, latent] Linears around the routed experts; with config.expert_bias
/// their .bias [2 * moe_intermediate] / [hidden]: plain experts only), or, for weight-only
/// quantized experts (every expert's projections or none), their .qweight / .scales / .zeros as
/// Linear::load reads them (run by fused_moe_quantized), and shared_experts.* of a GatedMLP (an
/// UngatedMLP for relu2) when the config has shared experts. Split over tensor-parallel ranks
/// (the weights' communicator; not the latent projections),
/// every expert (and the shared one) holds this rank's columns of the intermediate size, the
/// router is replicated, and the combined output is summed over the ranks once.
class SparseMoE : public FeedForward {
 public:
  /// Throws std::invalid_argument on a missing weight.
  SparseMoE(const MoEConfig& config, const std::string& prefix, const WeightMap& weights);

  /// No LoRA on experts: lora_slots is not read.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& lora_slots) const override;
  int64_t weight_bytes() const override;

  /// The routing of tokens x [T, hidden]: fp32 weights [T, k] and int64 expert ids [T, k].
  std::pair<at::Tensor, at::Tensor> route(const at::Tensor& x) const;

 private:
  /// The routing from the router's logits [T, num_experts] (ops::moe_routing with the config's
  /// scoring, grouping and scaling); throws c10::Error when the config cannot route.
  std::pair<at::Tensor, at::Tensor> route_logits(const at::Tensor& logits) const;

  MoEConfig config_;
  at::Tensor router_;          // [num_experts, hidden], fp32 when config.fp32_router
  at::Tensor router_bias_;     // [num_experts], or undefined
  at::Tensor score_bias_;      // fp32 [num_experts], sigmoid scoring only
  std::vector<at::Tensor> w13_, w2_;  // per expert, plain or packed (ops::linear_prepack)
  at::Tensor w13_bias_, w2_bias_;  // [num_experts, 2 * inter] / [num_experts, hidden], or none
  std::vector<QuantizedLinearWeight> w13_quantized_, w2_quantized_;  // or these
  Linear latent_in_, latent_out_;  // fc1 / fc2 latent projections, or undefined
  std::unique_ptr<FeedForward> shared_;
  std::shared_ptr<Communicator> reduce_;  // null: one rank
};

}  // namespace kvserve
