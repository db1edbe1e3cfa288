// CUDA launcher for layer_norm: the CPU launcher's checks, then one block per token on the
// current stream.
#include <torch/library.h>

#include <algorithm>

#include "kernels/cuda_launch.h"
#include "kernels/norm/layer_norm.h"
#include "kernels/norm/layer_norm_checks.h"
#include "kernels/norm/layer_norm_kernel.cuh"

namespace kvserve::ops {
namespace {

void layer_norm_cuda(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias, double epsilon) {
  check_layer_norm(out, input, weight, bias);
  if (input.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor w = weight.to(at::kFloat).contiguous();
  const at::Tensor b = bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const int threads = static_cast<int>(std::min<int64_t>(1024, (input.size(1) + 31) / 32 * 32));
  cuda::dispatch_float(input.scalar_type(), "layer_norm", [&](auto type) {
    using T = typename decltype(type)::type;
    cuda::layer_norm_kernel<T><<<input.size(0), threads, 0, cuda::current_stream()>>>(
        static_cast<T*>(out.data_ptr()), out.stride(0), static_cast<const T*>(input.data_ptr()),
        input.stride(0), w.data_ptr<float>(), b.defined() ? b.data_ptr<float>() : nullptr,
        input.size(1), static_cast<float>(epsilon));
  });
  KVSERVE_CUDA_CHECK_LAUNCH();
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CUDA, m) { m.impl("layer_norm", &layer_norm_cuda); }

}  // namespace kvserve::ops
