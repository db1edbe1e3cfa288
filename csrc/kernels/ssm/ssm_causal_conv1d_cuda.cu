// CUDA launcher for ssm_causal_conv1d: the CPU launcher's checks (but for the values of
// cu_seqlens and slots, which the kernel bounds instead of reading them on the host), then a
// thread per (sequence, channel) on the current stream.
#include <torch/library.h>

#include <type_traits>

#include "kernels/cuda_launch.h"
#include "kernels/ssm/ssm_causal_conv1d.h"
#include "kernels/ssm/ssm_causal_conv1d_kernel.cuh"
#include "kernels/ssm/ssm_checks.h"

namespace kvserve::ops {
namespace {

void ssm_causal_conv1d_cuda(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, at::Tensor& conv_state,
                            const at::Tensor& cu_seqlens, const at::Tensor& slots,
                            const at::Tensor& has_initial_state, bool silu) {
  const int64_t num_seqs = check_ssm_causal_conv1d(out, input, weight, bias, conv_state,
                                                   cu_seqlens, slots, has_initial_state);
  if (num_seqs == 0) return;
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor w = weight.to(at::kFloat).contiguous();
  const std::optional<at::Tensor> b =
      bias ? std::optional<at::Tensor>(bias->to(at::kFloat).contiguous()) : std::nullopt;
  const int64_t dim = input.size(1);
  constexpr int kThreads = 128;
  const dim3 grid(static_cast<unsigned>((dim + kThreads - 1) / kThreads),
                  static_cast<unsigned>(num_seqs));
  cuda::dispatch_float(input.scalar_type(), "ssm_causal_conv1d", [&](auto type) {
    using T = typename decltype(type)::type;
    const auto launch = [&](auto* state) {
      using S = std::remove_pointer_t<decltype(state)>;
      cuda::ssm_causal_conv1d_kernel<T, S><<<grid, kThreads, 0, cuda::current_stream()>>>(
          static_cast<T*>(out.data_ptr()), out.stride(0),
          static_cast<const T*>(input.data_ptr()), input.stride(0), w.data_ptr<float>(),
          b ? b->data_ptr<float>() : nullptr, state, cu_seqlens.data_ptr<int32_t>(),
          slots.data_ptr<int32_t>(), has_initial_state.data_ptr<bool>(), input.size(0),
          conv_state.size(0), dim, static_cast<int>(weight.size(1)), silu);
    };
    if (conv_state.scalar_type() == at::kFloat) {
      launch(static_cast<float*>(conv_state.data_ptr()));
    } else {
      launch(static_cast<T*>(conv_state.data_ptr()));
    }
  });
  KVSERVE_CUDA_CHECK_LAUNCH();
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CUDA, m) { m.impl("ssm_causal_conv1d", &ssm_causal_conv1d_cuda); }

}  // namespace kvserve::ops
