// CPU launcher for fused_moe: each active expert's gate_up projection, SwiGLU and down projection
// run on its tokens through the linear op (GEMV for a few tokens, oneDNN GEMM on packed weights
// for more); routed_experts_cpu groups the tokens and sums the weighted outputs.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "kernels/activation/silu_and_mul.h"
#include "kernels/linear/linear.h"
#include "kernels/moe/fused_moe.h"
#include "kernels/moe/routed_experts_cpu.h"
#include "kernels/op_checks.h"

namespace kvserve::ops {
namespace {

constexpr const char* kOp = "fused_moe";

void check_experts(const char* name, at::TensorList weights, int64_t rows, int64_t cols,
                   const at::Tensor& hidden) {
  for (const at::Tensor& w : weights) {
    TORCH_CHECK(w.dim() == 2 && w.size(0) == rows && w.size(1) == cols, kOp, ": every ", name,
                " must be [", rows, ", ", cols, "], got ", w.sizes());
    TORCH_CHECK(w.scalar_type() == hidden.scalar_type(), kOp, ": ", name,
                " must have hidden's dtype ", hidden.scalar_type(), ", got ", w.scalar_type());
  }
}

at::Tensor fused_moe_cpu(const at::Tensor& hidden, at::TensorList w13, at::TensorList w2,
                         const at::Tensor& topk_weights, const at::Tensor& topk_ids) {
  check_rows(kOp, "hidden", hidden, 2);
  const int64_t hidden_size = hidden.size(1);
  const int64_t num_experts = static_cast<int64_t>(w13.size());
  TORCH_CHECK(num_experts > 0 && w2.size() == w13.size(), kOp,
              ": need one w13 and one w2 per expert, got ", w13.size(), " and ", w2.size());
  const int64_t inter2 = w13[0].size(0);
  TORCH_CHECK(w13[0].dim() == 2 && inter2 % 2 == 0, kOp,
              ": w13 must be [2 * inter, hidden_size], got ", w13[0].sizes());
  check_experts("w13", w13, inter2, hidden_size, hidden);
  check_experts("w2", w2, hidden_size, inter2 / 2, hidden);
  return routed_experts_cpu(
      kOp, hidden, num_experts, topk_weights, topk_ids, [&](int64_t e, const at::Tensor& x) {
        const at::Tensor gate_up = linear(x, w13[e], std::nullopt);
        at::Tensor act = at::empty({x.size(0), inter2 / 2}, x.options());
        silu_and_mul(act, gate_up);
        return linear(act, w2[e], std::nullopt);
      });
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("fused_moe", &fused_moe_cpu); }
// Packed expert weights are MKLDNN tensors, whose dispatch key outranks CPU's.
TORCH_LIBRARY_IMPL(kvserve, MkldnnCPU, m) { m.impl("fused_moe", &fused_moe_cpu); }

}  // namespace kvserve::ops
