#pragma once
// Dense linear layer y = x W^T + b over flattened tokens.

#include <ATen/core/Tensor.h>

namespace kvserve {

/// A dense projection; quantized variants come as siblings with the same forward().
class Linear {
 public:
  Linear() = default;
  /// weight [out_features, in_features]; bias [out_features] or undefined. One copy of the weight
  /// is kept: packed by ops::linear_prepack where the device's GEMM has a packed layout that
  /// kvserve's GEMV reads too (fp32 / bf16 on CPU), else the plain weight.
  Linear(at::Tensor weight, at::Tensor bias);

  /// x [T, in_features] -> [T, out_features], in the weight dtype.
  at::Tensor forward(const at::Tensor& x) const;

  /// Rows `ids` (int64 [T]) of the weight, [T, in_features]: a tied embedding's lookup.
  at::Tensor rows(const at::Tensor& ids) const;

  int64_t in_features() const { return weight_.size(1); }
  int64_t out_features() const { return weight_.size(0); }
  bool packed() const { return weight_.is_mkldnn(); }
  bool defined() const { return weight_.defined(); }
  /// Bytes of the weight as held (a packed one pads its blocks) and the bias; 0 when undefined.
  int64_t weight_bytes() const;

 private:
  at::Tensor weight_;  // plain [out, in], or packed by ops::linear_prepack
  at::Tensor bias_;
};

}  // namespace kvserve
