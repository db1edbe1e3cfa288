#pragma once
// Gated MLP of the Llama family: down(silu(gate(x)) * up(x)) with gate and up fused.

#include <ATen/core/Tensor.h>

#include <string>

#include "layers/feed_forward.h"
#include "layers/linear.h"
#include "layers/weights.h"

namespace kvserve {

/// Weights: `<prefix>gate_up_proj.weight` [2 * intermediate, hidden] (gate rows first),
/// `<prefix>down_proj.weight` [hidden, intermediate], optional biases.
class GatedMLP : public FeedForward {
 public:
  GatedMLP(const std::string& prefix, const WeightMap& weights);

  /// x [T, hidden] -> [T, hidden].
  at::Tensor forward(const at::Tensor& x) const override;

  int64_t weight_bytes() const override {
    return gate_up_proj_.weight_bytes() + down_proj_.weight_bytes();
  }

 private:
  at::Tensor forward_chunk(const at::Tensor& x) const;

  Linear gate_up_proj_;
  Linear down_proj_;
};

}  // namespace kvserve
