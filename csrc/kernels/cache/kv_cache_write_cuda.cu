// CUDA launcher for kv_cache_write: the shared checks, then one block per (token, KV head) row of
// each cache. The slots stay on the device (reading them would synchronise); the kernel skips a
// slot outside the cache.
#include <torch/library.h>

#include "kernels/cache/kv_cache_write.h"
#include "kernels/cache/kv_cache_write_checks.h"
#include "kernels/cache/kv_cache_write_kernel.cuh"
#include "kernels/cuda_launch.h"

namespace kvserve::ops {
namespace {


template <typename T, cuda::KVFormat F>
void launch(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
            at::Tensor& value_cache, const at::Tensor& slot_mapping,
            const std::optional<at::Tensor>& key_scale,
            const std::optional<at::Tensor>& value_scale) {
  using Entry = typename cuda::KVEntry<T, F>::type;
  const int64_t num_tokens = slot_mapping.numel(), heads = key_cache.size(2);
  const int64_t head_dim = key_cache.size(3);
  const bool latent = value_cache.data_ptr() == key_cache.data_ptr();
  const dim3 grid(num_tokens, heads, latent ? 1 : 2);
  const int threads = cuda::kv_cache_write_threads(head_dim);
  cuda::kv_cache_write_kernel<T, F><<<grid, threads, 0, cuda::current_stream()>>>(
      static_cast<const T*>(key.data_ptr()), key.stride(0),
      static_cast<const T*>(value.data_ptr()), value.stride(0),
      static_cast<Entry*>(key_cache.data_ptr()), static_cast<Entry*>(value_cache.data_ptr()),
      key_scale ? key_scale->data_ptr<float>() : nullptr,
      value_scale ? value_scale->data_ptr<float>() : nullptr, slot_mapping.data_ptr<int64_t>(),
      key_cache.size(0) * key_cache.size(1), heads, head_dim);
  KVSERVE_CUDA_CHECK_LAUNCH();
}

void kv_cache_write_cuda(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                         at::Tensor& value_cache, const at::Tensor& slot_mapping,
                         const std::optional<at::Tensor>& key_scale,
                         const std::optional<at::Tensor>& value_scale) {
  const cpu::KVCacheFormat format = check_kv_cache_write(key, value, key_cache, value_cache,
                                                         slot_mapping, key_scale, value_scale);
  if (slot_mapping.numel() == 0 || key_cache.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(key.device());
  cuda::dispatch_float(key.scalar_type(), kv_cache_write_checks::kOp, [&](auto type) {
    using T = typename decltype(type)::type;
    switch (format) {
      case cpu::KVCacheFormat::kPlain:
        launch<T, cuda::KVFormat::kPlain>(key, value, key_cache, value_cache, slot_mapping,
                                          key_scale, value_scale);
        break;
      case cpu::KVCacheFormat::kInt8:
        launch<T, cuda::KVFormat::kInt8>(key, value, key_cache, value_cache, slot_mapping,
                                         key_scale, value_scale);
        break;
      case cpu::KVCacheFormat::kFp8E4M3:
        launch<T, cuda::KVFormat::kFp8E4M3>(key, value, key_cache, value_cache, slot_mapping,
                                            key_scale, value_scale);
        break;
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CUDA, m) { m.impl("kv_cache_write", &kv_cache_write_cuda); }

}  // namespace kvserve::ops
