// CUDA launcher for rms_norm_gated: the CPU launcher's checks, then one block per (group,
// token) on the current stream.
#include <torch/library.h>

#include "kernels/cuda_launch.h"
#include "kernels/norm/rms_norm_gated.h"
#include "kernels/norm/rms_norm_gated_checks.h"
#include "kernels/norm/rms_norm_gated_kernel.cuh"

namespace kvserve::ops {
namespace {

void rms_norm_gated_cuda(at::Tensor& out, const at::Tensor& input,
                         const std::optional<at::Tensor>& gate,
                         const std::optional<at::Tensor>& weight, int64_t group_size,
                         double epsilon, bool norm_before_gate) {
  check_rms_norm_gated(out, input, gate, weight, group_size);
  if (input.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor w = weight ? weight->to(at::kFloat).contiguous() : at::Tensor();
  const dim3 grid(static_cast<unsigned>(input.size(1) / group_size),
                  static_cast<unsigned>(input.size(0)));
  const int threads = static_cast<int>(std::min<int64_t>(512, (group_size + 31) / 32 * 32));
  cuda::dispatch_float(input.scalar_type(), "rms_norm_gated", [&](auto type) {
    using T = typename decltype(type)::type;
    cuda::rms_norm_gated_kernel<T><<<grid, threads, 0, cuda::current_stream()>>>(
        static_cast<T*>(out.data_ptr()), out.stride(0), static_cast<const T*>(input.data_ptr()),
        input.stride(0), gate ? static_cast<const T*>(gate->data_ptr()) : nullptr,
        gate ? gate->stride(0) : 0, w.defined() ? w.data_ptr<float>() : nullptr, group_size,
        static_cast<float>(epsilon), norm_before_gate);
  });
  KVSERVE_CUDA_CHECK_LAUNCH();
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CUDA, m) { m.impl("rms_norm_gated", &rms_norm_gated_cuda); }

}  // namespace kvserve::ops
