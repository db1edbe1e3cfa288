// CPU launchers for rms_norm and fused_add_rms_norm.
#include <torch/library.h>

#include "kernels/cpu_kernels.h"
#include "kernels/norm/rms_norm.h"
#include "kernels/op_checks.h"

namespace kvserve::ops {
namespace {

void check_norm_args(const char* op, const at::Tensor& x, const at::Tensor& weight) {
  check_rows(op, "input", x, 2);
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() || weight.scalar_type() == at::kFloat, op,
              ": weight must have input's dtype ", x.scalar_type(), " or be float32, got ",
              weight.scalar_type());
  TORCH_CHECK(weight.device() == x.device(), op, ": weight is on ", weight.device(),
              ", expected ", x.device());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(), op,
              ": weight must be contiguous [", x.size(1), "], got ", weight.sizes());
}

void rms_norm_cpu(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                  double epsilon) {
  check_norm_args("rms_norm", input, weight);
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
  check_norm_args("fused_add_rms_norm", input, weight);
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
