// CPU launcher for gelu_tanh_and_mul.
#include <torch/library.h>

#include "kernels/activation/gelu_tanh_and_mul.h"
#include "kernels/cpu_kernels.h"
#include "kernels/op_checks.h"

namespace kvserve::ops {
namespace {

void gelu_tanh_and_mul_cpu(at::Tensor& out, const at::Tensor& input) {
  check_gated_activation("gelu_tanh_and_mul", out, input);
  cpu::gelu_tanh_and_mul_stub.get()(input.scalar_type(), out.data_ptr(), out.stride(0),
                                    input.data_ptr(), input.stride(0), input.size(0),
                                    out.size(1));
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("gelu_tanh_and_mul", &gelu_tanh_and_mul_cpu); }

}  // namespace kvserve::ops
