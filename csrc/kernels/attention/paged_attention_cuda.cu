// CUDA launcher for paged_attention: the shared checks, then a split-K kernel (the row kernel for
// head sizes 64, 128 and 256, the general one otherwise), and the merge of the splits when a
// call has too few (token, head group) blocks to fill the GPU. The metadata stays on the device
// (reading it would synchronise): the number of splits comes from the block table's width, an
// upper bound on every context.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <type_traits>

#include "kernels/attention/paged_attention.h"
#include "kernels/attention/paged_attention_checks.h"
#include "kernels/attention/paged_attention_kernel.cuh"
#include "kernels/attention/paged_attention_rows_kernel.cuh"
#include "kernels/cuda_launch.h"

namespace kvserve::ops {
namespace {

using paged_attention_checks::kOp;

// Read once per device: a call inside CUDA-graph capture must not query the driver.
int multiprocessors(int device) {
  static std::array<std::atomic<int>, 64> counts{};
  std::atomic<int>& count = counts.at(static_cast<size_t>(device));
  if (count.load(std::memory_order_relaxed) == 0) {
    int value = 0;
    cudaDeviceGetAttribute(&value, cudaDevAttrMultiProcessorCount, device);
    count.store(std::max(value, 1), std::memory_order_relaxed);
  }
  return count.load(std::memory_order_relaxed);
}

// Thread blocks of one wave per multiprocessor, times this: enough to hide memory latency.
constexpr int64_t kBlocksPerMultiprocessor = 4;
// Splits never hold fewer positions than this (their merge would cost more than they save).
constexpr int64_t kMinPartition = 256;

// Splits each context into partitions (multiples of `step` positions) when the (token, head
// group) blocks alone would not fill the GPU, then launches `kernel` and the merge.
template <typename T, int HPB>
void launch(void (*kernel)(cuda::PagedAttentionParams), cuda::PagedAttentionParams& p,
            int64_t num_tokens, int sms, int64_t step, const at::Tensor& query) {
  p.head_blocks_per_kv_head = (p.num_heads / p.num_kv_heads + HPB - 1) / HPB;
  const int64_t head_blocks = static_cast<int64_t>(p.num_kv_heads) * p.head_blocks_per_kv_head;
  const int64_t max_context = static_cast<int64_t>(p.max_blocks_per_seq) * p.block_size;
  const int64_t blocks = num_tokens * head_blocks;
  int64_t splits = 1;
  if (blocks < sms * kBlocksPerMultiprocessor) {
    splits = std::min((max_context + kMinPartition - 1) / kMinPartition,
                      (sms * kBlocksPerMultiprocessor + blocks - 1) / blocks);
    splits = std::max<int64_t>(splits, 1);
  }
  int64_t partition = (max_context + splits - 1) / splits;
  partition = std::max<int64_t>((partition + step - 1) / step * step, 1);
  p.num_splits = static_cast<int>((max_context + partition - 1) / partition);
  p.partition = static_cast<int>(partition);
  at::Tensor workspace;
  if (p.num_splits > 1) {
    const int64_t partials = num_tokens * p.num_heads * p.num_splits;
    workspace = at::empty({partials * (p.value_head_dim + 2)},
                          query.options().dtype(at::kFloat));
    p.partial_out = workspace.data_ptr<float>();
    p.partial_max = p.partial_out + partials * p.value_head_dim;
    p.partial_sum = p.partial_max + partials;
  }
  const cudaStream_t stream = cuda::current_stream();
  const dim3 grid(num_tokens, head_blocks, p.num_splits);
  kernel<<<grid, cuda::kAttentionThreads, 0, stream>>>(p);
  KVSERVE_CUDA_CHECK_LAUNCH();
  if (p.num_splits > 1) {
    const dim3 merge_grid(num_tokens, p.num_heads);
    cuda::paged_attention_merge_kernel<T><<<merge_grid, 128, 0, stream>>>(p);
    KVSERVE_CUDA_CHECK_LAUNCH();
  }
}

// The row kernel (paged_attention_rows_kernel.cuh) for keys and values of one size, 64, 128 or
// 256, in caches whose rows are aligned for its vector loads; false where it does not apply.
template <typename T, cuda::KVFormat F>
bool launch_rows(cuda::PagedAttentionParams& p, int64_t num_tokens, int sms,
                 const at::Tensor& query) {
  using Entry = typename cuda::KVEntry<T, F>::type;
  const int d = p.head_dim;
  constexpr uintptr_t kAlignment = 8 * sizeof(Entry) < 16 ? 8 * sizeof(Entry) : 16;
  const auto aligned = [](const void* ptr) {
    return reinterpret_cast<uintptr_t>(ptr) % kAlignment == 0;
  };
  if ((d != 64 && d != 128 && d != 256) || p.value_head_dim != d || p.value_row != d ||
      !aligned(p.key_cache) || !aligned(p.value_cache)) {
    return false;
  }
  const int group = p.num_heads / p.num_kv_heads;
  const auto with_heads = [&](auto heads_per_block) {
    constexpr int HPB = decltype(heads_per_block)::value;
    // Rows in flight per lane, twice over (pipelined): fewer where registers are short (fp32
    // rows take two 16-byte loads; 8 heads hold 128 floats of queries and accumulators).
    constexpr int kRows = sizeof(Entry) == 4 || HPB >= 8 ? 2 : 4;
    const auto for_dim = [&](auto head_dim) {
      constexpr int D = decltype(head_dim)::value;
      launch<T, HPB>(cuda::paged_attention_rows_kernel<T, F, D, HPB, kRows>, p, num_tokens, sms,
                     cuda::rows_kernel_step<D, kRows>(), query);
    };
    if (d == 64) {
      for_dim(std::integral_constant<int, 64>{});
    } else if (d == 128) {
      for_dim(std::integral_constant<int, 128>{});
    } else {
      for_dim(std::integral_constant<int, 256>{});
    }
  };
  switch (cuda::rows_heads_per_block(group)) {
    case 1: with_heads(std::integral_constant<int, 1>{}); break;
    case 2: with_heads(std::integral_constant<int, 2>{}); break;
    case 4: with_heads(std::integral_constant<int, 4>{}); break;
    default: with_heads(std::integral_constant<int, 8>{}); break;
  }
  return true;
}

// Otherwise the general kernel, by head size: the queries and accumulators of HPB heads live in
// registers (2 * HPB * DPL floats per thread).
template <typename T, cuda::KVFormat F>
void launch_for_head_dim(cuda::PagedAttentionParams& p, int64_t num_tokens, int sms,
                         const at::Tensor& query) {
  if (launch_rows<T, F>(p, num_tokens, sms, query)) return;
  const int widest = std::max(p.head_dim, p.value_head_dim);
  if (widest <= 128) {
    launch<T, 8>(cuda::paged_attention_kernel<T, F, 4, 8>, p, num_tokens, sms, 1, query);
  } else if (widest <= 256) {
    launch<T, 4>(cuda::paged_attention_kernel<T, F, 8, 4>, p, num_tokens, sms, 1, query);
  } else {
    TORCH_CHECK(widest <= 576, kOp, ": head dimensions up to 576 on CUDA, got ", widest);
    launch<T, 2>(cuda::paged_attention_kernel<T, F, 18, 2>, p, num_tokens, sms, 1, query);
  }
}

void paged_attention_cuda(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                          const at::Tensor& value_cache, const at::Tensor& query_start_loc,
                          const at::Tensor& seq_lens, const at::Tensor& block_tables,
                          double scale, int64_t sliding_window, double logit_softcap,
                          const std::optional<at::Tensor>& key_scale,
                          const std::optional<at::Tensor>& value_scale) {
  const cpu::KVCacheFormat format =
      check_paged_attention(out, query, key_cache, value_cache, query_start_loc, seq_lens,
                            block_tables, key_scale, value_scale);
  const int64_t num_tokens = query.size(0);
  if (num_tokens == 0 || seq_lens.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(query.device());
  cuda::PagedAttentionParams p{};
  p.out = out.data_ptr();
  p.query = query.data_ptr();
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.key_scale = key_scale ? key_scale->data_ptr<float>() : nullptr;
  p.value_scale = value_scale ? value_scale->data_ptr<float>() : nullptr;
  p.query_start_loc = query_start_loc.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.out_stride = out.stride(0);
  p.query_stride = query.stride(0);
  p.cache_block_stride = key_cache.stride(0);
  p.value_cache_block_stride = value_cache.stride(0);
  p.value_row = value_cache.size(3);
  p.num_seqs = static_cast<int>(seq_lens.numel());
  p.num_heads = static_cast<int>(query.size(1));
  p.num_kv_heads = static_cast<int>(key_cache.size(2));
  p.head_dim = static_cast<int>(query.size(2));
  p.value_head_dim = static_cast<int>(out.size(2));
  p.block_size = static_cast<int>(key_cache.size(1));
  p.max_blocks_per_seq = static_cast<int>(block_tables.size(1));
  p.num_blocks = static_cast<int>(key_cache.size(0));
  cuda::host_block_divisor(p);
  p.scale = static_cast<float>(scale);
  p.sliding_window = static_cast<int>(std::clamp<int64_t>(sliding_window, 0, INT32_MAX));
  p.logit_softcap = static_cast<float>(logit_softcap);
  if (p.max_blocks_per_seq == 0) {
    out.zero_();
    return;
  }
  const int sms = multiprocessors(query.device().index());
  cuda::dispatch_float(query.scalar_type(), kOp, [&](auto type) {
    using T = typename decltype(type)::type;
    switch (format) {
      case cpu::KVCacheFormat::kPlain:
        launch_for_head_dim<T, cuda::KVFormat::kPlain>(p, num_tokens, sms, query);
        break;
      case cpu::KVCacheFormat::kInt8:
        launch_for_head_dim<T, cuda::KVFormat::kInt8>(p, num_tokens, sms, query);
        break;
      case cpu::KVCacheFormat::kFp8E4M3:
        launch_for_head_dim<T, cuda::KVFormat::kFp8E4M3>(p, num_tokens, sms, query);
        break;
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CUDA, m) { m.impl("paged_attention", &paged_attention_cuda); }

}  // namespace kvserve::ops
