#pragma once
// The MLP half of a decoder layer, whatever its kind: a dense gated MLP or a mixture of experts.

#include <ATen/core/Tensor.h>

#include <vector>

#include "layers/linear.h"

namespace kvserve {

/// Maps every token's hidden state on its own: x [T, hidden] -> [T, hidden].
class FeedForward {
 public:
  virtual ~FeedForward() = default;
  /// lora_slots: int32 [T] adapter slot per token (-1: none), or undefined (AttentionMetadata).
  virtual at::Tensor forward(const at::Tensor& x, const at::Tensor& lora_slots) const = 0;
  /// Its projections that can serve LoRA adapters, by name under its prefix (none by default).
  virtual std::vector<LoraLinear> lora_linears() { return {}; }
  /// Bytes of all weights as held.
  virtual int64_t weight_bytes() const = 0;
};

}  // namespace kvserve
