// CPU launcher for rms_norm_gated.
#include <torch/library.h>

#include "kernels/cpu_kernels.h"
#include "kernels/norm/rms_norm_gated.h"
#include "kernels/norm/rms_norm_gated_checks.h"

namespace kvserve::ops {
namespace {

void rms_norm_gated_cpu(at::Tensor& out, const at::Tensor& input,
                        const std::optional<at::Tensor>& gate,
                        const std::optional<at::Tensor>& weight, int64_t group_size,
                        double epsilon, bool norm_before_gate) {
  check_rms_norm_gated(out, input, gate, weight, group_size);
  const at::Tensor w = weight ? weight->to(at::kFloat).contiguous() : at::Tensor();
  cpu::rms_norm_gated_stub.get()(input.scalar_type(), out.data_ptr(), out.stride(0),
                                 input.data_ptr(), input.stride(0),
                                 gate ? gate->data_ptr() : nullptr, gate ? gate->stride(0) : 0,
                                 w.defined() ? w.data_ptr<float>() : nullptr, input.size(0),
                                 input.size(1), group_size, static_cast<float>(epsilon),
                                 norm_before_gate);
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("rms_norm_gated", &rms_norm_gated_cpu); }

}  // namespace kvserve::ops
