// CPU launcher for fused_moe_quantized: each active expert's projections run quantized_linear on
// its tokens, with SwiGLU (or the squared ReLU of experts without a gate) between them; routed_experts_cpu groups the tokens and sums the
// weighted outputs.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>

#include "kernels/activation/silu_and_mul.h"
#include "kernels/linear/quantized_linear.h"
#include "kernels/moe/fused_moe_quantized.h"
#include "kernels/moe/fused_moe_quantized_checks.h"
#include "kernels/moe/routed_experts_cpu.h"

namespace kvserve::ops {
namespace {

constexpr const char* kOp = "fused_moe_quantized";

at::Tensor fused_moe_quantized_cpu(const at::Tensor& hidden, at::TensorList w13,
                                   at::TensorList w13_scales, at::TensorList w13_zeros,
                                   int64_t w13_group_size, at::TensorList w2,
                                   at::TensorList w2_scales, at::TensorList w2_zeros,
                                   int64_t w2_group_size, const at::Tensor& topk_weights,
                                   const at::Tensor& topk_ids, c10::string_view activation) {
  const int64_t inter =
      check_fused_moe_quantized(hidden, w13, w13_scales, w13_zeros, w13_group_size, w2,
                                w2_scales, w2_zeros, w2_group_size, topk_weights, topk_ids,
                                activation)
          .inter;
  const bool gated = activation == "silu";
  const size_t num_experts = w13.size();
  return routed_experts_cpu(
      kOp, hidden, static_cast<int64_t>(num_experts), topk_weights, topk_ids,
      [&](int64_t e, const at::Tensor& x) {
        const at::Tensor gate_up =
            quantized_linear(x, w13[e], w13_scales[e], moe_quantized_zeros(w13_zeros, e),
                             w13_group_size, std::nullopt);
        at::Tensor act = gated ? at::empty({x.size(0), inter}, x.options()) : gate_up;
        if (gated) silu_and_mul(act, gate_up);
        if (!gated) squared_relu_(act);
        return quantized_linear(act, w2[e], w2_scales[e], moe_quantized_zeros(w2_zeros, e),
                                w2_group_size, std::nullopt);
      });
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("fused_moe_quantized", &fused_moe_quantized_cpu); }

}  // namespace kvserve::ops
