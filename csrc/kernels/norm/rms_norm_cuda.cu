// CUDA launchers for rms_norm and fused_add_rms_norm: the CPU launchers' checks, then one block
// per token on the current stream, its row's values in registers (norm_plan).
#include <torch/library.h>

#include "kernels/cuda_launch.h"
#include "kernels/norm/rms_norm.h"
#include "kernels/norm/rms_norm_kernel.cuh"
#include "kernels/op_checks.h"

namespace kvserve::ops {
namespace {

// Calls f(Type<T>, Type<W>, integral_constant<P>): T the input's element type, W the weight's
// (T or fp32), P the values per thread of the plan for rows of `hidden`.
template <typename F>
void dispatch_norm(const at::Tensor& input, const at::Tensor& weight, const char* op,
                   int per_thread, F&& f) {
  cuda::dispatch_float(input.scalar_type(), op, [&](auto type) {
    using T = typename decltype(type)::type;
    cuda::dispatch_per_thread(per_thread, [&](auto values) {
      if (weight.scalar_type() == at::kFloat) {
        f(type, cuda::Type<float>{}, values);
      } else {
        f(type, cuda::Type<T>{}, values);
      }
    });
  });
}

void rms_norm_cuda(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                   double epsilon) {
  check_norm_weight("rms_norm", input, weight);
  check_rows("rms_norm", "out", out, 2);
  check_like("rms_norm", "out", out, input);
  TORCH_CHECK(out.sizes() == input.sizes(), "rms_norm: out must have the shape of input");
  if (input.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(input.device());
  const int64_t hidden = input.size(1);
  const cuda::NormPlan plan = cuda::norm_plan(hidden);
  const auto launch = [&](auto type, auto weight_type, auto values) {
    using T = typename decltype(type)::type;
    using W = typename decltype(weight_type)::type;
    constexpr int P = decltype(values)::value;
    cuda::rms_norm_kernel<T, W, P><<<input.size(0), plan.threads, 0, cuda::current_stream()>>>(
        static_cast<T*>(out.data_ptr()), out.stride(0), static_cast<const T*>(input.data_ptr()),
        input.stride(0), static_cast<const W*>(weight.data_ptr()), hidden,
        static_cast<float>(epsilon));
  };
  dispatch_norm(input, weight, "rms_norm", plan.per_thread, launch);
  KVSERVE_CUDA_CHECK_LAUNCH();
}

void fused_add_rms_norm_cuda(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight,
                             double epsilon) {
  check_norm_weight("fused_add_rms_norm", input, weight);
  check_rows("fused_add_rms_norm", "residual", residual, 2);
  check_like("fused_add_rms_norm", "residual", residual, input);
  TORCH_CHECK(residual.sizes() == input.sizes(),
              "fused_add_rms_norm: residual must have the shape of input");
  if (input.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(input.device());
  const int64_t hidden = input.size(1);
  const cuda::NormPlan plan = cuda::norm_plan(hidden);
  const auto launch = [&](auto type, auto weight_type, auto values) {
    using T = typename decltype(type)::type;
    using W = typename decltype(weight_type)::type;
    constexpr int P = decltype(values)::value;
    cuda::fused_add_rms_norm_kernel<T, W, P>
        <<<input.size(0), plan.threads, 0, cuda::current_stream()>>>(
            static_cast<T*>(input.data_ptr()), input.stride(0),
            static_cast<T*>(residual.data_ptr()), residual.stride(0),
            static_cast<const W*>(weight.data_ptr()), hidden, static_cast<float>(epsilon));
  };
  dispatch_norm(input, weight, "fused_add_rms_norm", plan.per_thread, launch);
  KVSERVE_CUDA_CHECK_LAUNCH();
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CUDA, m) {
  m.impl("rms_norm", &rms_norm_cuda);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm_cuda);
}

}  // namespace kvserve::ops
