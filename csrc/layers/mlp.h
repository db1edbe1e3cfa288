#pragma once
// Gated MLP of the Llama family: down(act(gate(x)) * up(x)) with gate and up fused; act is SiLU
// (SwiGLU) or tanh-approximated GELU (GeGLU, Gemma). And the MLP without a gate:
// down(relu(up(x))^2) (Nemotron-H's squared ReLU).

#include <ATen/core/Tensor.h>

#include <string>
#include <stdexcept>

#include "layers/feed_forward.h"
#include "layers/linear.h"
#include "layers/weights.h"

namespace kvserve {

/// Weights: `<prefix>gate_up_proj.weight` [2 * intermediate, hidden] (gate rows first),
/// `<prefix>down_proj.weight` [hidden, intermediate], optional biases.
class GatedMLP : public FeedForward {
 public:
  /// hidden_act: "silu" or "gelu_pytorch_tanh"; throws std::invalid_argument otherwise.
  /// Split over tensor-parallel ranks (the weights' communicator), down_proj's outputs are
  /// summed over them, unless `partial` (a mixture's shared expert, summed with the experts).
  GatedMLP(const std::string& prefix, const WeightMap& weights,
           const std::string& hidden_act = "silu", bool partial = false);

  /// x [T, hidden] -> [T, hidden], with each token's LoRA update where lora_slots says.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& lora_slots) const override;
  /// Without adapters (a mixture's shared expert).
  at::Tensor forward(const at::Tensor& x) const { return forward(x, at::Tensor()); }
  std::vector<LoraLinear> lora_linears() override {
    return {{"gate_up_proj", &gate_up_proj_, 2}, {"down_proj", &down_proj_, 1}};
  }

  int64_t weight_bytes() const override {
    return gate_up_proj_.weight_bytes() + down_proj_.weight_bytes();
  }

 private:
  at::Tensor forward_chunk(const at::Tensor& x, const at::Tensor& lora_slots) const;

  Linear gate_up_proj_;
  Linear down_proj_;
  bool gelu_ = false;  // GeGLU instead of SwiGLU
};

/// Weights: `<prefix>up_proj.weight` [intermediate, hidden], `<prefix>down_proj.weight` [hidden,
/// intermediate], optional biases. Split over tensor-parallel ranks as GatedMLP is.
class UngatedMLP : public FeedForward {
 public:
  /// hidden_act: "relu2" (relu(x)^2); throws std::invalid_argument otherwise.
  UngatedMLP(const std::string& prefix, const WeightMap& weights,
             const std::string& hidden_act = "relu2");

  at::Tensor forward(const at::Tensor& x, const at::Tensor& lora_slots) const override;
  std::vector<LoraLinear> lora_linears() override {
    return {{"up_proj", &up_proj_, 1}, {"down_proj", &down_proj_, 1}};
  }
  int64_t weight_bytes() const override {
    return up_proj_.weight_bytes() + down_proj_.weight_bytes();
  }

 private:
  Linear up_proj_;
  Linear down_proj_;
};

}  // namespace kvserve
