// CPU launcher for silu_and_mul.
#include <torch/library.h>

#include "kernels/activation/silu_and_mul.h"
#include "kernels/cpu_kernels.h"
#include "kernels/op_checks.h"

namespace kvserve::ops {
namespace {

void silu_and_mul_cpu(at::Tensor& out, const at::Tensor& input) {
  check_rows("silu_and_mul", "input", input, 2);
  check_rows("silu_and_mul", "out", out, 2);
  check_like("silu_and_mul", "out", out, input);
  const int64_t d = input.size(1) / 2;
  TORCH_CHECK(input.size(1) % 2 == 0 && out.size(0) == input.size(0) && out.size(1) == d,
              "silu_and_mul: expected input [T, 2d] and out [T, d], got ", input.sizes(), " and ",
              out.sizes());
  cpu::silu_and_mul_stub.get()(input.scalar_type(), out.data_ptr(), out.stride(0), input.data_ptr(),
                               input.stride(0), input.size(0), d);
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("silu_and_mul", &silu_and_mul_cpu); }

}  // namespace kvserve::ops
