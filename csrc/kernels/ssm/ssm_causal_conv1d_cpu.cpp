// CPU launcher for ssm_causal_conv1d.
#include <torch/library.h>

#include "kernels/cpu_kernels.h"
#include "kernels/ssm/ssm_causal_conv1d.h"
#include "kernels/ssm/ssm_checks.h"

namespace kvserve::ops {
namespace {

void ssm_causal_conv1d_cpu(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias, at::Tensor& conv_state,
                           const at::Tensor& cu_seqlens, const at::Tensor& slots,
                           const at::Tensor& has_initial_state, bool silu) {
  const int64_t num_seqs = check_ssm_causal_conv1d(out, input, weight, bias, conv_state,
                                                   cu_seqlens, slots, has_initial_state);
  check_state_sequence_values("ssm_causal_conv1d", cu_seqlens, slots, input.size(0),
                              conv_state.size(0));
  const at::Tensor w = weight.to(at::kFloat).contiguous();
  const std::optional<at::Tensor> b =
      bias ? std::optional<at::Tensor>(bias->to(at::kFloat).contiguous()) : std::nullopt;
  cpu::ssm_causal_conv1d_stub.get()(
      input.scalar_type(), out.data_ptr(), out.stride(0), input.data_ptr(), input.stride(0),
      w.data_ptr<float>(), b ? b->data_ptr<float>() : nullptr, conv_state.data_ptr(),
      conv_state.scalar_type() == at::kFloat, cu_seqlens.data_ptr<int32_t>(),
      slots.data_ptr<int32_t>(), has_initial_state.data_ptr<bool>(), num_seqs, input.size(1),
      weight.size(1), silu);
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("ssm_causal_conv1d", &ssm_causal_conv1d_cpu); }

}  // namespace kvserve::ops
