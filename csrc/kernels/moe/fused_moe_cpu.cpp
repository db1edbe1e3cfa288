// CPU launcher for fused_moe: each active expert's gate_up projection, its gate (SwiGLU; or the
// squared ReLU of an up projection alone) and down projection
// run on its tokens through the linear op (GEMV for a few tokens, oneDNN GEMM on packed weights
// for more); routed_experts_cpu groups the tokens and sums the weighted outputs.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "kernels/activation/clamped_swiglu_and_mul.h"
#include "kernels/activation/silu_and_mul.h"
#include "kernels/linear/linear.h"
#include "kernels/moe/fused_moe.h"
#include "kernels/moe/fused_moe_checks.h"
#include "kernels/moe/routed_experts_cpu.h"

namespace kvserve::ops {
namespace {

constexpr const char* kOp = "fused_moe";

// Expert e's row of the biases (none without them).
std::optional<at::Tensor> bias_of(const std::optional<at::Tensor>& biases, int64_t e) {
  return biases ? std::optional<at::Tensor>(biases->select(0, e)) : std::nullopt;
}

at::Tensor fused_moe_cpu(const at::Tensor& hidden, at::TensorList w13, at::TensorList w2,
                         const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                         const std::optional<at::Tensor>& w13_bias,
                         const std::optional<at::Tensor>& w2_bias, c10::string_view activation,
                         double alpha, double limit) {
  const bool gated = check_moe_activation(kOp, activation, alpha, limit);
  const int64_t inter =
      check_fused_moe(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, gated);
  const bool clamped = activation == "clamped_swiglu";
  const int64_t num_experts = static_cast<int64_t>(w13.size());
  return routed_experts_cpu(
      kOp, hidden, num_experts, topk_weights, topk_ids, [&](int64_t e, const at::Tensor& x) {
        const at::Tensor gate_up = linear(x, w13[e], bias_of(w13_bias, e));
        if (!gated) return linear(squared_relu_(gate_up), w2[e], bias_of(w2_bias, e));
        at::Tensor act = at::empty({x.size(0), inter}, x.options());
        if (clamped) {
          clamped_swiglu_and_mul(act, gate_up, alpha, limit);
        } else {
          silu_and_mul(act, gate_up);
        }
        return linear(act, w2[e], bias_of(w2_bias, e));
      });
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("fused_moe", &fused_moe_cpu); }
// Packed expert weights are MKLDNN tensors, whose dispatch key outranks CPU's.
TORCH_LIBRARY_IMPL(kvserve, MkldnnCPU, m) { m.impl("fused_moe", &fused_moe_cpu); }

}  // namespace kvserve::ops
