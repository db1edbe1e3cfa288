// CPU launcher for silu_and_mul.
#include <torch/library.h>

#include "kernels/activation/silu_and_mul.h"
#include "kernels/cpu_kernels.h"
#include "kernels/op_checks.h"

namespace kvserve::ops {
namespace {

void silu_and_mul_cpu(at::Tensor& out, const at::Tensor& input) {
  check_gated_activation("silu_and_mul", out, input);
  const int64_t d = out.size(1);
  cpu::silu_and_mul_stub.get()(input.scalar_type(), out.data_ptr(), out.stride(0), input.data_ptr(),
                               input.stride(0), input.size(0), d);
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("silu_and_mul", &silu_and_mul_cpu); }

}  // namespace kvserve::ops
