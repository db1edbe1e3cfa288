#pragma once
// The MLP half of a decoder layer, whatever its kind: a dense gated MLP or a mixture of experts.

#include <ATen/core/Tensor.h>

namespace kvserve {

/// Maps every token's hidden state on its own: x [T, hidden] -> [T, hidden].
class FeedForward {
 public:
  virtual ~FeedForward() = default;
  virtual at::Tensor forward(const at::Tensor& x) const = 0;
  /// Bytes of all weights as held.
  virtual int64_t weight_bytes() const = 0;
};

}  // namespace kvserve
