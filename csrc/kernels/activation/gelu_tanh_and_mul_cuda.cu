// CUDA launcher for gelu_tanh_and_mul: the CPU launcher's checks, then the shared gated-activation
// body (blocks tile each token's outputs).
#include <torch/library.h>

#include "kernels/activation/gelu_tanh_and_mul.h"
#include "kernels/activation/gelu_tanh_and_mul_kernel.cuh"
#include "kernels/cuda_launch.h"
#include "kernels/op_checks.h"

namespace kvserve::ops {
namespace {

void gelu_tanh_and_mul_cuda(at::Tensor& out, const at::Tensor& input) {
  check_gated_activation("gelu_tanh_and_mul", out, input);
  if (input.size(0) == 0 || out.size(1) == 0) return;
  const c10::cuda::CUDAGuard guard(input.device());
  const int64_t d = out.size(1);
  const dim3 grid(static_cast<unsigned int>(input.size(0)), cuda::gated_activation_splits(d));
  TORCH_CHECK(grid.y <= 65535, "gelu_tanh_and_mul: ", d,
              " outputs a token are more than one launch covers");
  cuda::dispatch_float(input.scalar_type(), "gelu_tanh_and_mul", [&](auto type) {
    using T = typename decltype(type)::type;
    cuda::gated_activation_kernel<T, cuda::GeluTanhGate>
        <<<grid, cuda::kGatedThreads, 0, cuda::current_stream()>>>(
            static_cast<T*>(out.data_ptr()), out.stride(0),
            static_cast<const T*>(input.data_ptr()), input.stride(0), d,
            cuda::GeluTanhGate{});
  });
  KVSERVE_CUDA_CHECK_LAUNCH();
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CUDA, m) { m.impl("gelu_tanh_and_mul", &gelu_tanh_and_mul_cuda); }

}  // namespace kvserve::ops
