// CUDA launcher for rotary_embedding: the shared checks, then one block per token. Positions stay
// on the device (reading them would synchronise); the kernel skips one outside the cache.
#include <torch/library.h>

#include "kernels/cuda_launch.h"
#include "kernels/rotary/rotary_embedding.h"
#include "kernels/rotary/rotary_embedding_checks.h"
#include "kernels/rotary/rotary_embedding_kernel.cuh"

namespace kvserve::ops {
namespace {

void rotary_embedding_cuda(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                           int64_t head_dim, const at::Tensor& cos_sin_cache, bool is_neox) {
  check_rotary_embedding(positions, query, key, head_dim, cos_sin_cache);
  const int64_t num_tokens = positions.numel();
  if (num_tokens == 0 || cos_sin_cache.size(1) == 0) return;
  const c10::cuda::CUDAGuard guard(query.device());
  cuda::dispatch_float(query.scalar_type(), "rotary_embedding", [&](auto type) {
    using T = typename decltype(type)::type;
    cuda::rotary_embedding_kernel<T><<<num_tokens, 128, 0, cuda::current_stream()>>>(
        positions.data_ptr<int64_t>(), static_cast<T*>(query.data_ptr()), query.stride(0),
        query.size(1) / head_dim, static_cast<T*>(key.data_ptr()), key.stride(0),
        key.size(1) / head_dim, head_dim, cos_sin_cache.data_ptr<float>(),
        cos_sin_cache.size(1), cos_sin_cache.size(0), is_neox);
  });
  KVSERVE_CUDA_CHECK_LAUNCH();
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CUDA, m) { m.impl("rotary_embedding", &rotary_embedding_cuda); }

}  // namespace kvserve::ops
