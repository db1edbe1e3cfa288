// CUDA launcher for fused_moe: the shared checks, the experts' weight pointers uploaded as one
// table, then the body's two passes (the gate per token-slot pair, down projection and weighted
// sum per token). The ids stay on the device (reading them would synchronise); the body skips one
// outside [0, num_experts), where the CPU launcher throws.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>

#include "kernels/cuda_launch.h"
#include "kernels/moe/fused_moe.h"
#include "kernels/moe/fused_moe_checks.h"
#include "kernels/moe/fused_moe_kernel.cuh"

namespace kvserve::ops {
namespace {

constexpr const char* kFusedMoe = "fused_moe";
constexpr int kFusedMoeWarps = 4;

// The data pointers of w13's experts, then w2's, on `device`.
at::Tensor device_pointers(at::TensorList w13, at::TensorList w2, const at::Device& device) {
  std::vector<const void*> addresses;
  for (at::TensorList list : {w13, w2}) {
    for (const at::Tensor& w : list) addresses.push_back(w.data_ptr());
  }
  return cuda::pointer_table(addresses, device);
}

at::Tensor fused_moe_cuda(const at::Tensor& hidden, at::TensorList w13, at::TensorList w2,
                          const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                          const std::optional<at::Tensor>& w13_bias,
                          const std::optional<at::Tensor>& w2_bias, c10::string_view activation,
                          double alpha, double limit) {
  const bool gated = check_moe_activation(kFusedMoe, activation, alpha, limit);
  const int64_t inter =
      check_fused_moe(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, gated);
  // limit 0: the plain SwiGLU.
  const cuda::MoeGate gate{static_cast<float>(alpha),
                           activation == "clamped_swiglu" ? static_cast<float>(limit) : 0.0f,
                           !gated};
  for (at::TensorList list : {w13, w2}) {
    for (const at::Tensor& w : list) {
      TORCH_CHECK(w.is_contiguous(), kFusedMoe, ": expert weights must be contiguous on CUDA");
    }
  }
  const int64_t num_tokens = hidden.size(0), hidden_size = hidden.size(1);
  const int64_t num_experts = static_cast<int64_t>(w13.size()), k = topk_ids.size(1);
  at::Tensor out = at::empty({num_tokens, hidden_size}, hidden.options());
  if (out.numel() == 0) return out;
  if (k == 0 || inter == 0) return out.zero_();  // no expert adds anything
  const c10::cuda::CUDAGuard guard(hidden.device());
  const at::Tensor pointers = device_pointers(w13, w2, hidden.device());
  at::Tensor act = at::empty({num_tokens * k, inter}, hidden.options().dtype(at::kFloat));
  cuda::dispatch_float(hidden.scalar_type(), kFusedMoe, [&](auto type) {
    using T = typename decltype(type)::type;
    const auto* table = reinterpret_cast<const T* const*>(pointers.data_ptr<int64_t>());
    const auto bias = [](const std::optional<at::Tensor>& b) {
      return b ? static_cast<const T*>(b->data_ptr()) : nullptr;
    };
    const dim3 gate_grid(num_tokens * k, cuda::blocks_for(inter, kFusedMoeWarps));
    cuda::moe_gate_up_kernel<T><<<gate_grid, 32 * kFusedMoeWarps, 0, cuda::current_stream()>>>(
        static_cast<const T*>(hidden.data_ptr()), hidden.stride(0), table, bias(w13_bias),
        topk_ids.data_ptr<int64_t>(), k, num_experts, hidden_size, inter, gate,
        act.data_ptr<float>());
    KVSERVE_CUDA_CHECK_LAUNCH();
    const dim3 down_grid(num_tokens, cuda::blocks_for(hidden_size, kFusedMoeWarps));
    cuda::moe_down_combine_kernel<T><<<down_grid, 32 * kFusedMoeWarps, 0,
                                       cuda::current_stream()>>>(
        act.data_ptr<float>(), table + num_experts, bias(w2_bias),
        topk_ids.data_ptr<int64_t>(),
        topk_weights.data_ptr<float>(), k, num_experts, hidden_size, inter,
        static_cast<T*>(out.data_ptr()));
    KVSERVE_CUDA_CHECK_LAUNCH();
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CUDA, m) { m.impl("fused_moe", &fused_moe_cuda); }

}  // namespace kvserve::ops
