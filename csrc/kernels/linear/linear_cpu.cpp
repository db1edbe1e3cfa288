// CPU launcher for linear: the streaming GEMV kernel for a few tokens, ATen's GEMM otherwise.
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include "kernels/cpu_kernels.h"
#include "kernels/linear/linear.h"
#include "kernels/op_checks.h"

namespace kvserve::ops {
namespace {

// Up to this many tokens the GEMV kernel wins: it reads the weight once per kGemvRowBlock tokens
// and its time is the weight's bytes over memory bandwidth. MKL's small-M GEMM runs on one core
// here and oneDNN's bf16 one at about half the bandwidth (benchmarks/bench_decode.py).
constexpr int64_t kMaxGemvTokens = 8;

at::Tensor linear_cpu(const at::Tensor& input, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "linear";
  check_rows(op, "input", input, 2);
  check_like(op, "weight", weight, input);
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == input.size(1), op, ": weight must be [out, ",
              input.size(1), "], got ", weight.sizes());
  const int64_t m = input.size(0), n = weight.size(0), k = weight.size(1);
  if (bias) {
    check_like(op, "bias", *bias, input);
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous(), op,
                ": bias must be contiguous [", n, "]");
  }
  const bool small = m <= kMaxGemvTokens && weight.is_contiguous() &&
                     (input.scalar_type() == at::kFloat || input.scalar_type() == at::kBFloat16 ||
                      input.scalar_type() == at::kHalf);
  if (!small || m == 0 || n == 0) return at::linear(input, weight, bias);
  at::Tensor out = at::empty({m, n}, input.options());
  cpu::gemv_stub.get()(input.scalar_type(), input.data_ptr(), input.stride(0), weight.data_ptr(),
                       bias ? bias->data_ptr() : nullptr, out.data_ptr(), m, n, k);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("linear", &linear_cpu); }

}  // namespace kvserve::ops
