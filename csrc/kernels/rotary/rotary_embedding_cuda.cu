// CUDA launcher for rotary_embedding: the shared checks, then a block per token, several for a
// few tokens (rotary_splits; the normed kernel when heads are normalized first). Positions stay on the device (reading them would
// synchronise); the kernel skips one outside the cache.
#include <torch/library.h>

#include <optional>

#include "kernels/cuda_launch.h"
#include "kernels/rotary/rotary_embedding.h"
#include "kernels/rotary/rotary_embedding_checks.h"
#include "kernels/rotary/rotary_embedding_kernel.cuh"

namespace kvserve::ops {
namespace {

void rotary_embedding_cuda(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                           int64_t head_dim, const at::Tensor& cos_sin_cache, bool is_neox,
                           const std::optional<at::Tensor>& query_norm,
                           const std::optional<at::Tensor>& key_norm, double norm_epsilon) {
  check_rotary_embedding(positions, query, key, head_dim, cos_sin_cache);
  const at::ScalarType norm_type =
      check_head_norms(query, head_dim, query_norm, key_norm, norm_epsilon);
  const int64_t num_tokens = positions.numel();
  const bool normed = norm_type != at::ScalarType::Undefined;
  if (num_tokens == 0 || (cos_sin_cache.size(1) == 0 && !normed)) return;
  const c10::cuda::CUDAGuard guard(query.device());
  const int64_t num_heads = query.size(1) / head_dim, num_kv_heads = key.size(1) / head_dim;
  cuda::dispatch_float(query.scalar_type(), "rotary_embedding", [&](auto type) {
    using T = typename decltype(type)::type;
    auto* q = static_cast<T*>(query.data_ptr());
    auto* k = static_cast<T*>(key.data_ptr());
    if (!normed) {
      const dim3 grid(static_cast<unsigned int>(num_tokens),
                      cuda::rotary_splits(num_tokens, (num_heads + num_kv_heads) *
                                                          (cos_sin_cache.size(1) / 2),
                                          cuda::kRotaryThreads));
      cuda::rotary_embedding_kernel<T>
          <<<grid, cuda::kRotaryThreads, 0, cuda::current_stream()>>>(
          positions.data_ptr<int64_t>(), q, query.stride(0), num_heads, k, key.stride(0),
          num_kv_heads, head_dim, cos_sin_cache.data_ptr<float>(), cos_sin_cache.size(1),
          cos_sin_cache.size(0), is_neox);
      return;
    }
    auto launch = [&](auto weight_type) {
      using W = typename decltype(weight_type)::type;
      auto weight = [](const std::optional<at::Tensor>& w) {
        return w ? static_cast<const W*>(w->data_ptr()) : nullptr;
      };
      const int threads = cuda::rotary_normed_threads(num_heads + num_kv_heads);
      const dim3 grid(static_cast<unsigned int>(num_tokens),
                      cuda::rotary_splits(num_tokens, num_heads + num_kv_heads, threads / 32));
      cuda::rotary_embedding_normed_kernel<T, W>
          <<<grid, threads, 0, cuda::current_stream()>>>(
              positions.data_ptr<int64_t>(), q, query.stride(0), num_heads, k, key.stride(0),
              num_kv_heads, head_dim, cos_sin_cache.data_ptr<float>(), cos_sin_cache.size(1),
              cos_sin_cache.size(0), is_neox, weight(query_norm), weight(key_norm),
              static_cast<float>(norm_epsilon));
    };
    if (norm_type == at::kFloat) {
      launch(cuda::Type<float>{});
    } else {
      launch(cuda::Type<T>{});
    }
  });
  KVSERVE_CUDA_CHECK_LAUNCH();
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CUDA, m) { m.impl("rotary_embedding", &rotary_embedding_cuda); }

}  // namespace kvserve::ops
