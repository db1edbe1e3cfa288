// CPU launcher for ssm_scan.
#include <torch/library.h>

#include "kernels/cpu_kernels.h"
#include "kernels/ssm/ssm_checks.h"
#include "kernels/ssm/ssm_scan.h"
#include "kernels/ssm/ssm_scan_args.h"

namespace kvserve::ops {
namespace {

void ssm_scan_cpu(at::Tensor& out, const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A,
                  const at::Tensor& B, const at::Tensor& C, const std::optional<at::Tensor>& D,
                  const std::optional<at::Tensor>& dt_bias, at::Tensor& state,
                  const at::Tensor& cu_seqlens, const at::Tensor& slots,
                  const at::Tensor& has_initial_state, bool dt_softplus, double dt_min,
                  double dt_max) {
  const int64_t num_seqs = check_ssm_scan(out, x, dt, A, B, C, D, dt_bias, state, cu_seqlens,
                                          slots, has_initial_state);
  check_dt_limits(dt_min, dt_max);
  check_state_sequence_values("ssm_scan", cu_seqlens, slots, x.size(0), state.size(0));
  const std::optional<at::Tensor> d =
      D ? std::optional<at::Tensor>(D->to(at::kFloat).contiguous()) : std::nullopt;
  const std::optional<at::Tensor> bias =
      dt_bias ? std::optional<at::Tensor>(dt_bias->to(at::kFloat).contiguous()) : std::nullopt;
  cpu::ssm_scan_stub.get()(
      x.scalar_type(),
      ssm_scan_args(out, x, dt, B, C, state, cu_seqlens, slots, has_initial_state, num_seqs,
                    A.data_ptr<float>(), A.dim() == 2, d ? d->data_ptr<float>() : nullptr,
                    bias ? bias->data_ptr<float>() : nullptr, dt_softplus, dt_min, dt_max));
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("ssm_scan", &ssm_scan_cpu); }

}  // namespace kvserve::ops
