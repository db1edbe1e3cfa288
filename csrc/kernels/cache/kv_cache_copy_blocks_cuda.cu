// CUDA launcher for kv_cache_copy_blocks: one launch for every layer and pair. A block_mapping
// on the host (the engine's) is checked like the CPU launcher's, then uploaded; one already on
// the device is used as is (reading it would synchronise) and the kernel skips ids outside the
// pool.
#include <torch/library.h>

#include <vector>

#include "kernels/cache/kv_cache_copy_blocks.h"
#include "kernels/cache/kv_cache_copy_blocks_checks.h"
#include "kernels/cache/kv_cache_copy_blocks_kernel.cuh"
#include "kernels/cuda_launch.h"

namespace kvserve::ops {
namespace {

void kv_cache_copy_blocks_cuda(at::TensorList key_caches, at::TensorList value_caches,
                               const at::Tensor& block_mapping) {
  check_kv_cache_copy_blocks(key_caches, value_caches, block_mapping);
  const at::Tensor& first = key_caches[0];
  const int64_t num_pairs = block_mapping.size(0), num_blocks = first.size(0);
  if (num_pairs == 0 || first.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(first.device());
  at::Tensor pairs = block_mapping;
  if (pairs.is_cpu()) {
    check_block_pairs(pairs.data_ptr<int64_t>(), num_pairs, num_blocks);
    pairs = pairs.to(first.device());
  }
  TORCH_CHECK(pairs.device() == first.device(), "kv_cache_copy_blocks: block_mapping is on ",
              pairs.device(), ", the caches on ", first.device());
  std::vector<const void*> pointers;
  for (const auto* list : {&key_caches, &value_caches}) {
    for (const at::Tensor& cache : *list) pointers.push_back(cache.data_ptr());
  }
  const at::Tensor device_pointers = cuda::pointer_table(pointers, first.device());
  const int64_t block_bytes = first.numel() / num_blocks * first.element_size();
  const dim3 grid(num_pairs, pointers.size());
  auto launch = [&](auto unit) {
    using U = typename decltype(unit)::type;
    cuda::kv_cache_copy_blocks_kernel<U><<<grid, 256, 0, cuda::current_stream()>>>(
        reinterpret_cast<U* const*>(device_pointers.data_ptr<int64_t>()),
        pairs.data_ptr<int64_t>(), num_blocks, block_bytes / static_cast<int64_t>(sizeof(U)));
  };
  // Blocks start at multiples of block_bytes from 256-byte aligned allocations.
  if (block_bytes % 16 == 0) {
    launch(cuda::Type<uint4>{});
  } else if (block_bytes % 4 == 0) {
    launch(cuda::Type<uint32_t>{});
  } else {
    launch(cuda::Type<uint8_t>{});
  }
  KVSERVE_CUDA_CHECK_LAUNCH();
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CUDA, m) {
  m.impl("kv_cache_copy_blocks", &kv_cache_copy_blocks_cuda);
}

}  // namespace kvserve::ops
