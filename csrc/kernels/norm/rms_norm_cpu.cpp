// CPU launchers for rms_norm and fused_add_rms_norm.
#include <torch/library.h>

#include "kernels/cpu_kernels.h"
#include "kernels/norm/rms_norm.h"
#include "kernels/op_checks.h"

namespace kvserve::ops {
namespace {

void rms_norm_cpu(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                  double epsilon) {
  check_norm_weight("rms_norm", input, weight);
  check_rows("rms_norm", "out", out, 2);
  check_like("rms_norm", "out", out, input);
  TORCH_CHECK(out.sizes() == input.sizes(), "rms_norm: out must have the shape of input");
  cpu::rms_norm_stub.get()(input.scalar_type(), out.data_ptr(), out.stride(0), input.data_ptr(),
                           input.stride(0), weight.data_ptr(), weight.scalar_type() == at::kFloat,
                           input.size(0), input.size(1),
                           static_cast<float>(epsilon));
}

void fused_add_rms_norm_cpu(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight,
                            double epsilon) {
  check_norm_weight("fused_add_rms_norm", input, weight);
  check_rows("fused_add_rms_norm", "residual", residual, 2);
  check_like("fused_add_rms_norm", "residual", residual, input);
  TORCH_CHECK(residual.sizes() == input.sizes(),
              "fused_add_rms_norm: residual must have the shape of input");
  cpu::fused_add_rms_norm_stub.get()(input.scalar_type(), input.data_ptr(), input.stride(0),
                                     residual.data_ptr(), residual.stride(0), weight.data_ptr(),
                                     weight.scalar_type() == at::kFloat, input.size(0), input.size(1), static_cast<float>(epsilon));
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("rms_norm", &rms_norm_cpu);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm_cpu);
}

}  // namespace kvserve::ops
