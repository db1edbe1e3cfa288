#pragma once
// The host half of paged_attention's CUDA launcher, apart from the CUDA runtime so that the
// kernel emulator's tests (tests/cpp/test_paged_attention_emulated.cpp) run it too: parameters
// from the tensors, the choice of kernel (tensor cores for bf16 / fp16 queries with head size 64,
// 128 or 256, the row kernel for fp32 calls of those sizes, the general one otherwise),
// the tile shape, and the split of long contexts when too few blocks would fill the GPU. The
// metadata stays on the device (reading it would synchronise): grids are bounds from the shapes
// and the number of splits comes from the block table's width. `launch(kernel, grid, threads,
// shared_bytes, params)` starts a kernel, on a stream (paged_attention_cuda.cu) or emulated;
// `launch.resident_blocks(kernel, threads, shared_bytes)` is how many fit on a multiprocessor,
// `launch.tensor_cores()` whether the GPU has sm_80's mma / ldmatrix / cp.async.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>

#include "kernels/attention/paged_attention_kernel.cuh"
#include "kernels/attention/paged_attention_kernel_choice.h"
#include "kernels/attention/paged_attention_mma_kernel.cuh"
#include "kernels/attention/paged_attention_rows_kernel.cuh"

namespace kvserve::ops::paged_attention_launch {

using Kernel = AttentionKernel;

/// Kernel parameters of a checked call (split fields are set by launch_split).
inline cuda::PagedAttentionParams make_params(
    at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
    const at::Tensor& value_cache, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
    const at::Tensor& block_tables, double scale, int64_t sliding_window, double logit_softcap,
    const std::optional<at::Tensor>& key_scale, const std::optional<at::Tensor>& value_scale,
    const std::optional<at::Tensor>& sinks = std::nullopt) {
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
  p.sinks = sinks ? sinks->data_ptr<float>() : nullptr;
  return p;
}

// Splits never hold fewer positions than this (their merge would cost more than they save).
constexpr int64_t kMinPartition = 256;

/// Splits of each context for `blocks` (query tile, head block) blocks when `slots` blocks fit
/// on the GPU at once (multiprocessors x resident blocks of the kernel): none when the blocks
/// fill 80% of a wave; otherwise the fewest, up to max_splits, whose waves are at least 85% as
/// full as the fullest choice's (FlashAttention's heuristic for its split-KV decode).
inline int64_t split_count(int64_t blocks, int64_t slots, int64_t max_splits) {
  blocks = std::max<int64_t>(blocks, 1);
  slots = std::max<int64_t>(slots, 1);
  if (5 * blocks >= 4 * slots || max_splits <= 1) return 1;
  const auto efficiency = [&](int64_t splits) {
    const double waves = static_cast<double>(blocks * splits) / static_cast<double>(slots);
    return waves / std::ceil(waves);
  };
  double best = 0.0;
  for (int64_t splits = 1; splits <= max_splits; ++splits) {
    best = std::max(best, efficiency(splits));
  }
  for (int64_t splits = 1; splits <= max_splits; ++splits) {
    if (efficiency(splits) >= 0.85 * best) return splits;
  }
  return 1;
}

/// Launches `kernel` on a grid of `tiles` x (KV heads x head blocks of `heads_per_block`) x
/// splits, and the merge of the splits: contexts are split into partitions (multiples of `step`
/// positions) by split_count, from `useful_tiles` x head blocks and the kernel's occupancy of
/// `sms` multiprocessors (launch.resident_blocks).
template <typename T, typename Launch>
void launch_split(void (*kernel)(cuda::PagedAttentionParams), cuda::PagedAttentionParams& p,
                  int64_t tiles, int64_t useful_tiles, int heads_per_block, int sms, int64_t step,
                  size_t shared_bytes, const at::Tensor& query, Launch& launch) {
  p.head_blocks_per_kv_head = (p.num_heads / p.num_kv_heads + heads_per_block - 1) /
                              heads_per_block;
  const int64_t head_blocks = static_cast<int64_t>(p.num_kv_heads) * p.head_blocks_per_kv_head;
  const int64_t max_context = static_cast<int64_t>(p.max_blocks_per_seq) * p.block_size;
  const int64_t slots = static_cast<int64_t>(sms) *
                        launch.resident_blocks(kernel, cuda::kAttentionThreads, shared_bytes);
  const int64_t splits = split_count(useful_tiles * head_blocks, slots,
                                     (max_context + kMinPartition - 1) / kMinPartition);
  int64_t partition = (max_context + splits - 1) / splits;
  partition = std::max<int64_t>((partition + step - 1) / step * step, 1);
  p.num_splits = static_cast<int>((max_context + partition - 1) / partition);
  p.partition = static_cast<int>(partition);
  at::Tensor workspace;
  const int64_t num_tokens = query.size(0);
  if (p.num_splits > 1) {
    const int64_t partials = num_tokens * p.num_heads * p.num_splits;
    workspace = at::empty({partials * (p.value_head_dim + 2)}, query.options().dtype(at::kFloat));
    p.partial_out = workspace.data_ptr<float>();
    p.partial_max = p.partial_out + partials * p.value_head_dim;
    p.partial_sum = p.partial_max + partials;
  }
  launch(kernel, dim3(tiles, head_blocks, p.num_splits), cuda::kAttentionThreads, shared_bytes, p);
  if (p.num_splits > 1) {
    launch(cuda::paged_attention_merge_kernel<T>, dim3(num_tokens, p.num_heads), 128, 0, p);
  }
}

/// The tensor-core kernel for bf16 / fp16 queries over caches (of their dtype, int8 or fp8) of
/// keys and values of one size, 64, 128 or 256, or over MLA's latent (576 entries, values the
/// first 512), 16-byte aligned; false where it does not apply.
/// Tiles of 16 rows (one query token's GQA group, four warps splitting the positions) when
/// sequences bring few rows, as decode does; tiles of 128 rows otherwise (four warps of 32 rows,
/// FlashAttention-2's shape: each key and value fragment feeds two row tiles), or of 64 rows
/// (16 a warp) where `small_tiles` asks, for head size 256 and over quantized caches. Head size
/// 256 takes 32-position stages (shared memory), so its decode tiles are 32 rows, two warps per
/// 16 rows splitting the positions.
template <typename T, cuda::KVFormat F, typename Launch>
bool launch_mma(cuda::PagedAttentionParams& p, int64_t num_tokens, int sms,
                const at::Tensor& query, bool small_tiles, Launch& launch) {
  if constexpr (std::is_same_v<T, float>) {
    return false;
  } else {
    if (!launch.tensor_cores()) return false;
    const int d = p.head_dim;
    const auto aligned = [](const void* ptr) {
      return reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
    };
    // MLA's latent (DeepSeek-V2 / V3: rank 512 + 64 rotary entries), read as keys and values.
    const bool latent = p.key_cache == p.value_cache && p.num_kv_heads == 1 &&
                        p.value_row == d && d == 576 && p.value_head_dim == 512;
    if (!latent && ((d != 64 && d != 128 && d != 256) || p.value_head_dim != d ||
                    p.value_row != d)) {
      return false;
    }
    if (p.query_stride % 8 != 0 || !aligned(p.query) || !aligned(p.key_cache) ||
        !aligned(p.value_cache)) {
      return false;
    }
    const int group = p.num_heads / p.num_kv_heads;
    const int64_t rows_per_sequence =
        (num_tokens + p.num_seqs - 1) / std::max(p.num_seqs, 1) * group;
    const auto with_shape = [&](auto head_dim, auto warps_m, auto positions, auto latent_dim,
                                auto row_tiles) {
      constexpr int D = decltype(head_dim)::value, WM = decltype(warps_m)::value;
      constexpr int N = decltype(positions)::value, WN = cuda::kAttentionWarps / WM;
      constexpr int L = decltype(latent_dim)::value, MT = decltype(row_tiles)::value;
      using Shape = cuda::MmaAttentionShape<D, WM, WN, N, F != cuda::KVFormat::kPlain, L, MT>;
      const int tile_heads = cuda::mma_tile_heads(group, Shape::kRows);
      const int64_t tile_tokens = Shape::kRows / tile_heads;
      // Every sequence with a query takes a tile of its own: a decode step of B sequences
      // brings B tiles, not B / tile_tokens.
      const int64_t useful_tiles =
          std::max<int64_t>((num_tokens + tile_tokens - 1) / tile_tokens,
                            std::min<int64_t>(p.num_seqs, num_tokens));
      launch_split<T>(cuda::paged_attention_mma_kernel<T, F, D, WM, WN, N, L, MT>, p,
                      num_tokens / tile_tokens + p.num_seqs, useful_tiles, tile_heads, sms, N,
                      Shape::kSharedBytes, query, launch);
    };
    using I = std::integral_constant<int, 1>;
    using II = std::integral_constant<int, 2>;
    using IV = std::integral_constant<int, 4>;
    using N32 = std::integral_constant<int, 32>;
    using N64 = std::integral_constant<int, 64>;
    using Plain = std::integral_constant<int, 0>;
    const bool decode_tiles = rows_per_sequence <= 16;
    // Prefill tiles of 128 rows when they would be at least half full and fill the GPU's
    // multiprocessors with two each (their occupancy), over 16-bit caches (a quantized stage's
    // dequantizing leaves registers for one row tile). On an H200 a 512-token prompt of 32 / 8
    // heads took 0.118 ms in 128 blocks of 128 rows, 0.070 ms in 256 blocks of 64.
    const int64_t wide_blocks = (num_tokens * group + 127) / 128 * p.num_kv_heads;
    const bool wide_tiles = !small_tiles && rows_per_sequence > 64 && wide_blocks >= 2 * sms;
    const auto prefill_tiles = [&](auto head_dim) {
      if constexpr (F == cuda::KVFormat::kPlain) {
        if (wide_tiles) return with_shape(head_dim, IV{}, N64{}, Plain{}, II{});
      }
      with_shape(head_dim, IV{}, N64{}, Plain{}, I{});
    };
    if (latent) {
      // 16 heads a block, the warps splitting the positions for scores and the value entries
      // for outputs: 32 positions a stage (72 KiB of latent rows in two stages).
      with_shape(std::integral_constant<int, 576>{}, I{}, N32{},
                 std::integral_constant<int, 512>{}, I{});
    } else if (d == 64) {
      using D64 = std::integral_constant<int, 64>;
      decode_tiles ? with_shape(D64{}, I{}, N64{}, Plain{}, I{}) : prefill_tiles(D64{});
    } else if (d == 128) {
      using D128 = std::integral_constant<int, 128>;
      decode_tiles ? with_shape(D128{}, I{}, N64{}, Plain{}, I{}) : prefill_tiles(D128{});
    } else {
      using D256 = std::integral_constant<int, 256>;
      decode_tiles ? with_shape(D256{}, II{}, N32{}, Plain{}, I{})
                   : with_shape(D256{}, IV{}, N32{}, Plain{}, I{});
    }
    return true;
  }
}

/// The row kernel for keys and values of one size, 64, 128 or 256, in caches whose rows are
/// aligned for its vector loads; false where it does not apply.
template <typename T, cuda::KVFormat F, typename Launch>
bool launch_rows(cuda::PagedAttentionParams& p, int64_t num_tokens, int sms,
                 const at::Tensor& query, Launch& launch) {
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
      launch_split<T>(cuda::paged_attention_rows_kernel<T, F, D, HPB, kRows>, p, num_tokens,
                      num_tokens, HPB, sms, cuda::rows_kernel_step<D, kRows>(), 0, query, launch);
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

/// The first kernel of `kernel`'s choice that applies, down to the general one: the queries and
/// accumulators of HPB heads live in its registers (2 * HPB * DPL floats per thread).
template <typename T, cuda::KVFormat F, typename Launch>
void launch_kernel(cuda::PagedAttentionParams& p, int64_t num_tokens, int sms,
                   const at::Tensor& query, Kernel kernel, Launch& launch) {
  if (kernel == Kernel::kAuto || kernel == Kernel::kMma || kernel == Kernel::kMma64) {
    if (launch_mma<T, F>(p, num_tokens, sms, query, kernel == Kernel::kMma64, launch)) return;
  }
  if (kernel != Kernel::kGeneral) {
    if (launch_rows<T, F>(p, num_tokens, sms, query, launch)) return;
  }
  const int widest = std::max(p.head_dim, p.value_head_dim);
  if (widest <= 128) {
    launch_split<T>(cuda::paged_attention_kernel<T, F, 4, 8>, p, num_tokens, num_tokens, 8, sms,
                    1, 0, query, launch);
  } else if (widest <= 256) {
    launch_split<T>(cuda::paged_attention_kernel<T, F, 8, 4>, p, num_tokens, num_tokens, 4, sms,
                    1, 0, query, launch);
  } else {
    TORCH_CHECK(widest <= 576, "paged_attention: head dimensions up to 576 on CUDA, got ", widest);
    launch_split<T>(cuda::paged_attention_kernel<T, F, 18, 2>, p, num_tokens, num_tokens, 2, sms,
                    1, 0, query, launch);
  }
}

}  // namespace kvserve::ops::paged_attention_launch
