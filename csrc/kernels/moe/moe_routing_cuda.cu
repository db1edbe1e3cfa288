// CUDA launcher for moe_routing: the shared checks, then one warp per token, with each warp's
// scores, choices and flags in shared memory.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>
#include <string_view>
#include <tuple>

#include "kernels/cuda_launch.h"
#include "kernels/moe/moe_routing.h"
#include "kernels/moe/moe_routing_checks.h"
#include "kernels/moe/moe_routing_kernel.cuh"

namespace kvserve::ops {
namespace {

constexpr int64_t kMaxWarpsPerBlock = 4;
// Dynamic shared memory a block may take without opting in (cudaFuncSetAttribute).
constexpr int64_t kDefaultSharedBytes = 48 << 10;

std::tuple<at::Tensor, at::Tensor> moe_routing_cuda(
    const at::Tensor& router_logits, const std::optional<at::Tensor>& correction_bias,
    int64_t top_k, c10::string_view scoring_func, int64_t n_group, int64_t topk_group,
    bool renormalize, double routed_scaling_factor) {
  check_moe_routing(router_logits, correction_bias, top_k, scoring_func, n_group, topk_group);
  const int64_t num_tokens = router_logits.size(0), num_experts = router_logits.size(1);
  const auto options = router_logits.options();
  at::Tensor weights = at::empty({num_tokens, top_k}, options.dtype(at::kFloat));
  at::Tensor ids = at::empty({num_tokens, top_k}, options.dtype(at::kLong));
  if (num_tokens == 0) return {weights, ids};
  const c10::cuda::CUDAGuard guard(router_logits.device());
  const bool has_bias = correction_bias.has_value() && correction_bias->defined();
  // Fewer warps per block when each needs much shared memory (hundreds of experts and more).
  int64_t warps = kMaxWarpsPerBlock;
  while (warps > 1 &&
         cuda::moe_routing_shared_bytes(warps, num_experts, n_group) > kDefaultSharedBytes) {
    --warps;
  }
  const int64_t shared = cuda::moe_routing_shared_bytes(warps, num_experts, n_group);
  cuda::dispatch_float(router_logits.scalar_type(), "moe_routing", [&](auto type) {
    using T = typename decltype(type)::type;
    const auto kernel = cuda::moe_routing_kernel<T>;
    if (shared > kDefaultSharedBytes) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(shared)));
    }
    kernel<<<cuda::blocks_for(num_tokens, static_cast<int>(warps)), 32 * warps, shared,
             cuda::current_stream()>>>(
        static_cast<const T*>(router_logits.data_ptr()), router_logits.stride(0),
        has_bias ? correction_bias->data_ptr<float>() : nullptr, num_tokens, num_experts, top_k,
        scoring_func == "sigmoid", n_group, topk_group, renormalize,
        static_cast<float>(routed_scaling_factor), weights.data_ptr<float>(),
        ids.data_ptr<int64_t>());
  });
  KVSERVE_CUDA_CHECK_LAUNCH();
  return {weights, ids};
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CUDA, m) { m.impl("moe_routing", &moe_routing_cuda); }

}  // namespace kvserve::ops
