// CUDA launcher for linear: dense projections go to cuBLAS(Lt) through torch, which picks its
// GEMV and GEMM kernels by shape; there is no packed layout on CUDA (linear_prepack gives none).
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include "kernels/cuda_launch.h"
#include "kernels/linear/linear.h"
#include "kernels/linear/linear_checks.h"

namespace kvserve::ops {
namespace {

at::Tensor linear_cuda(const at::Tensor& input, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias) {
  check_linear(input, weight, bias);
  check_like("linear", "weight", weight, input);
  const c10::cuda::CUDAGuard guard(input.device());
  return at::linear(input, weight, bias);
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CUDA, m) { m.impl("linear", &linear_cuda); }

}  // namespace kvserve::ops
