// CUDA launcher for clamped_swiglu_and_mul: the CPU launcher's checks, then the shared
// gated-activation body (blocks tile each token's outputs).
#include <torch/library.h>

#include "kernels/activation/clamped_swiglu_and_mul.h"
#include "kernels/activation/clamped_swiglu_and_mul_checks.h"
#include "kernels/activation/clamped_swiglu_and_mul_kernel.cuh"
#include "kernels/cuda_launch.h"

namespace kvserve::ops {
namespace {

void clamped_swiglu_and_mul_cuda(at::Tensor& out, const at::Tensor& input, double alpha,
                                 double limit) {
  check_clamped_swiglu_and_mul(out, input, alpha, limit);
  if (input.size(0) == 0 || out.size(1) == 0) return;
  const c10::cuda::CUDAGuard guard(input.device());
  const int64_t d = out.size(1);
  const dim3 grid(static_cast<unsigned int>(input.size(0)), cuda::gated_activation_splits(d));
  TORCH_CHECK(grid.y <= 65535, "clamped_swiglu_and_mul: ", d,
              " outputs a token are more than one launch covers");
  const cuda::ClampedSwigluGate act{static_cast<float>(alpha), static_cast<float>(limit)};
  cuda::dispatch_float(input.scalar_type(), "clamped_swiglu_and_mul", [&](auto type) {
    using T = typename decltype(type)::type;
    cuda::gated_activation_kernel<T, cuda::ClampedSwigluGate>
        <<<grid, cuda::kGatedThreads, 0, cuda::current_stream()>>>(
            static_cast<T*>(out.data_ptr()), out.stride(0),
            static_cast<const T*>(input.data_ptr()), input.stride(0), d, act);
  });
  KVSERVE_CUDA_CHECK_LAUNCH();
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CUDA, m) {
  m.impl("clamped_swiglu_and_mul", &clamped_swiglu_and_mul_cuda);
}

}  // namespace kvserve::ops
