// CPU launcher for fused_moe_quantized: each active expert's projections run quantized_linear on
// its tokens, with SwiGLU between them; routed_experts_cpu groups the tokens and sums the
// weighted outputs.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>

#include "kernels/activation/silu_and_mul.h"
#include "kernels/linear/quantized_linear.h"
#include "kernels/moe/fused_moe_quantized.h"
#include "kernels/moe/routed_experts_cpu.h"
#include "kernels/op_checks.h"

namespace kvserve::ops {
namespace {

constexpr const char* kOp = "fused_moe_quantized";

// Every tensor of `list` has the dtype, shape and contiguity of list[0]; there is one per expert.
void check_like_first(const char* name, at::TensorList list, size_t num_experts) {
  TORCH_CHECK(list.size() == num_experts, kOp, ": ", name, " needs one tensor per expert (",
              num_experts, "), got ", list.size());
  for (const at::Tensor& t : list) {
    TORCH_CHECK(t.scalar_type() == list[0].scalar_type() && t.sizes() == list[0].sizes() &&
                    t.is_contiguous(),
                kOp, ": every ", name, " must be contiguous with the dtype and shape of ", name,
                "[0] (", list[0].scalar_type(), " ", list[0].sizes(), "), got ", t.scalar_type(),
                " ", t.sizes());
  }
}

std::optional<at::Tensor> zeros_of(at::TensorList zeros, int64_t e) {
  return zeros.empty() ? std::nullopt : std::optional<at::Tensor>(zeros[e]);
}

at::Tensor fused_moe_quantized_cpu(const at::Tensor& hidden, at::TensorList w13,
                                   at::TensorList w13_scales, at::TensorList w13_zeros,
                                   int64_t w13_group_size, at::TensorList w2,
                                   at::TensorList w2_scales, at::TensorList w2_zeros,
                                   int64_t w2_group_size, const at::Tensor& topk_weights,
                                   const at::Tensor& topk_ids) {
  check_rows(kOp, "hidden", hidden, 2);
  const size_t num_experts = w13.size();
  TORCH_CHECK(num_experts > 0, kOp, ": needs at least one expert");
  for (auto [name, list] : {std::pair{"w13", w13}, {"w13_scales", w13_scales}, {"w2", w2},
                            {"w2_scales", w2_scales}}) {
    check_like_first(name, list, num_experts);
  }
  if (!w13_zeros.empty()) check_like_first("w13_zeros", w13_zeros, num_experts);
  if (!w2_zeros.empty()) check_like_first("w2_zeros", w2_zeros, num_experts);
  TORCH_CHECK(w13[0].dim() == 2 && w13[0].size(0) % 2 == 0, kOp,
              ": w13 must be [2 * inter, packed hidden_size], got ", w13[0].sizes());
  const int64_t inter = w13[0].size(0) / 2;
  // Every expert has expert 0's format and shapes, so quantized_linear's checks on expert 0 with
  // no tokens check them all before any expert runs.
  const auto check = [&](const char* name, const at::Tensor& x, at::TensorList q,
                         at::TensorList scales, at::TensorList zeros, int64_t group_size) {
    try {
      quantized_linear(x, q[0], scales[0], zeros_of(zeros, 0), group_size, std::nullopt);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, kOp, ": ", name, ": ", e.what_without_backtrace());
    }
  };
  check("w13", hidden.narrow(0, 0, 0), w13, w13_scales, w13_zeros, w13_group_size);
  TORCH_CHECK(w2[0].dim() == 2 && w2[0].size(0) == hidden.size(1), kOp, ": w2 must have ",
              hidden.size(1), " rows (hidden_size), got ", w2[0].sizes());
  check("w2", at::empty({0, inter}, hidden.options()), w2, w2_scales, w2_zeros, w2_group_size);
  return routed_experts_cpu(
      kOp, hidden, static_cast<int64_t>(num_experts), topk_weights, topk_ids,
      [&](int64_t e, const at::Tensor& x) {
        const at::Tensor gate_up = quantized_linear(x, w13[e], w13_scales[e],
                                                    zeros_of(w13_zeros, e), w13_group_size,
                                                    std::nullopt);
        at::Tensor act = at::empty({x.size(0), inter}, x.options());
        silu_and_mul(act, gate_up);
        return quantized_linear(act, w2[e], w2_scales[e], zeros_of(w2_zeros, e), w2_group_size,
                                std::nullopt);
      });
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("fused_moe_quantized", &fused_moe_quantized_cpu); }

}  // namespace kvserve::ops
