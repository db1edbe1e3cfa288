// CPU launcher for clamped_swiglu_and_mul.
#include <torch/library.h>

#include "kernels/activation/clamped_swiglu_and_mul.h"
#include "kernels/activation/clamped_swiglu_and_mul_checks.h"
#include "kernels/cpu_kernels.h"

namespace kvserve::ops {
namespace {

void clamped_swiglu_and_mul_cpu(at::Tensor& out, const at::Tensor& input, double alpha,
                                double limit) {
  check_clamped_swiglu_and_mul(out, input, alpha, limit);
  cpu::clamped_swiglu_and_mul_stub.get()(input.scalar_type(), out.data_ptr(), out.stride(0),
                                         input.data_ptr(), input.stride(0), input.size(0),
                                         out.size(1), static_cast<float>(alpha),
                                         static_cast<float>(limit));
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("clamped_swiglu_and_mul", &clamped_swiglu_and_mul_cpu);
}

}  // namespace kvserve::ops
