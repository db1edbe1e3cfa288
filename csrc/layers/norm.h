#pragma once
// RMSNorm layer over the rms_norm ops.

#include <ATen/core/Tensor.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/empty_like.h>

#include "kernels/norm/rms_norm.h"

namespace kvserve {

/// RMSNorm with a learned scale; fp32 accumulation.
class RMSNorm {
 public:
  RMSNorm() = default;
  /// weight [hidden]. A nonzero offset scales by offset + weight, held in fp32 (Gemma's 1 + w,
  /// applied in fp32 before the output is rounded to the dtype).
  RMSNorm(const at::Tensor& weight, double eps, double offset = 0.0)
      : weight_(offset == 0.0 ? weight.contiguous()
                              : (weight.to(at::kFloat) + offset).contiguous()),
        eps_(eps) {}

  /// x [N, hidden] -> new tensor [N, hidden].
  at::Tensor forward(const at::Tensor& x) const {
    at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
    ops::rms_norm(out, x, weight_, eps_);
    return out;
  }

  /// In place: residual += x; x = norm(residual).
  void forward_fused(at::Tensor& x, at::Tensor& residual) const {
    ops::fused_add_rms_norm(x, residual, weight_, eps_);
  }

  bool defined() const { return weight_.defined(); }
  /// [hidden]: the model's dtype, or fp32 with an offset folded in.
  const at::Tensor& weight() const { return weight_; }
  double epsilon() const { return eps_; }
  int64_t weight_bytes() const { return weight_.defined() ? weight_.nbytes() : 0; }

 private:
  at::Tensor weight_;
  double eps_ = 1e-6;
};

}  // namespace kvserve
