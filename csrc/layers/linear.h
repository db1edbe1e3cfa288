#pragma once
// Dense linear layer y = x W^T + b over flattened tokens.

#include <ATen/core/Tensor.h>

namespace kvserve {

/// A dense projection; quantized variants come as siblings with the same forward().
class Linear {
 public:
  Linear() = default;
  /// weight [out_features, in_features]; bias [out_features] or undefined. Where the device has
  /// one, a packed copy of the weight is kept for the GEMM (beyond the few tokens that
  /// ops::linear leaves to the GEMV); the plain one stays for that GEMV, which decodes a few
  /// sequences at memory bandwidth.
  Linear(at::Tensor weight, at::Tensor bias);

  /// x [T, in_features] -> [T, out_features], in the weight dtype.
  at::Tensor forward(const at::Tensor& x) const;

  int64_t in_features() const { return weight_.size(1); }
  int64_t out_features() const { return weight_.size(0); }
  /// Bytes of the weight, its packed copy and the bias.
  int64_t weight_bytes() const;

 private:
  at::Tensor weight_;
  at::Tensor packed_weight_;  // undefined where the device has no packed layout
  at::Tensor bias_;
};

}  // namespace kvserve
