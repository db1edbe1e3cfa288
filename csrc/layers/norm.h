#pragma once
// Norm layers: RMSNorm over the rms_norm ops, LayerNorm over layer_norm, and a decoder's Norm
// (either, as the model's config says).

#include <ATen/core/Tensor.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/empty_like.h>

#include <optional>
#include <utility>

#include "kernels/norm/layer_norm.h"
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

/// LayerNorm: mean-centred, scaled by a learned weight, with an optional bias; fp32 statistics.
class LayerNorm {
 public:
  LayerNorm() = default;
  /// weight [hidden]; bias [hidden] or undefined (Cohere has none). Both held in fp32, so the
  /// weighting happens before the output's one rounding, as transformers' Cohere norm does.
  LayerNorm(const at::Tensor& weight, const at::Tensor& bias, double eps)
      : weight_(weight.to(at::kFloat).contiguous()),
        bias_(bias.defined() ? bias.to(at::kFloat).contiguous() : at::Tensor()),
        eps_(eps) {}

  /// x [N, hidden] -> new tensor [N, hidden].
  at::Tensor forward(const at::Tensor& x) const {
    at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
    ops::layer_norm(out, x, weight_, bias(), eps_);
    return out;
  }

  /// In place: residual += x (rounded to the dtype); x = norm(residual).
  void forward_fused(at::Tensor& x, at::Tensor& residual) const {
    residual.add_(x);
    ops::layer_norm(x, residual, weight_, bias(), eps_);
  }

  bool defined() const { return weight_.defined(); }
  int64_t weight_bytes() const {
    return (weight_.defined() ? weight_.nbytes() : 0) + (bias_.defined() ? bias_.nbytes() : 0);
  }

 private:
  std::optional<at::Tensor> bias() const {
    return bias_.defined() ? std::optional<at::Tensor>(bias_) : std::nullopt;
  }

  at::Tensor weight_, bias_;
  double eps_ = 1e-5;
};

/// A decoder's norm of the residual stream: an RMSNorm, or a LayerNorm where the model's
/// config says norm_type "layer_norm" (Cohere). Undefined: no norm there.
class Norm {
 public:
  Norm() = default;
  Norm(RMSNorm norm) : rms_(std::move(norm)) {}       // NOLINT(google-explicit-constructor)
  Norm(LayerNorm norm) : layer_(std::move(norm)) {}   // NOLINT(google-explicit-constructor)

  at::Tensor forward(const at::Tensor& x) const {
    return layer_.defined() ? layer_.forward(x) : rms_.forward(x);
  }
  void forward_fused(at::Tensor& x, at::Tensor& residual) const {
    if (layer_.defined()) {
      layer_.forward_fused(x, residual);
    } else {
      rms_.forward_fused(x, residual);
    }
  }
  bool defined() const { return rms_.defined() || layer_.defined(); }
  int64_t weight_bytes() const { return rms_.weight_bytes() + layer_.weight_bytes(); }

 private:
  RMSNorm rms_;
  LayerNorm layer_;
};

}  // namespace kvserve
