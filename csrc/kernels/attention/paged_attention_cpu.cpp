// CPU launcher for paged_attention: checks shapes and metadata, then runs the vectorized body.
#include <torch/library.h>

#include "kernels/attention/paged_attention.h"
#include "kernels/attention/paged_attention_checks.h"
#include "kernels/cpu_kernels.h"
#include "kernels/op_checks.h"

namespace kvserve::ops {
namespace {

using paged_attention_checks::kOp;

// Validates the attention metadata on the host so the kernel never reads outside the cache.
void check_metadata(const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                    const at::Tensor& block_tables, int64_t num_tokens, int64_t num_blocks,
                    int64_t block_size) {
  const int64_t num_seqs = seq_lens.numel();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t max_blocks = block_tables.size(1);
  TORCH_CHECK(qsl[0] == 0 && qsl[num_seqs] == num_tokens, kOp,
              ": query_start_loc must run from 0 to the number of tokens ", num_tokens);
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t query_len = qsl[b + 1] - qsl[b];
    TORCH_CHECK(query_len >= 0 && query_len <= lens[b], kOp, ": sequence ", b, " has ", query_len,
                " queries but a context of ", lens[b]);
    const int64_t blocks = (lens[b] + block_size - 1) / block_size;
    TORCH_CHECK(blocks <= max_blocks, kOp, ": sequence ", b, " needs ", blocks,
                " blocks, its table has ", max_blocks);
    for (int64_t i = 0; i < blocks; ++i) {
      const int32_t block = tables[b * max_blocks + i];
      TORCH_CHECK(block >= 0 && block < num_blocks, kOp, ": block id ", block,
                  " is outside the cache of ", num_blocks, " blocks");
    }
  }
}

void paged_attention_cpu(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                         const at::Tensor& value_cache, const at::Tensor& query_start_loc,
                         const at::Tensor& seq_lens, const at::Tensor& block_tables, double scale,
                         int64_t sliding_window, double logit_softcap,
                         const std::optional<at::Tensor>& key_scale,
                         const std::optional<at::Tensor>& value_scale,
                         const std::optional<at::Tensor>& sinks) {
  const cpu::KVCacheFormat format = check_paged_attention(
      out, query, key_cache, value_cache, query_start_loc, seq_lens, block_tables, key_scale,
      value_scale, sinks);
  const int64_t num_heads = query.size(1), num_kv_heads = key_cache.size(2);
  check_metadata(query_start_loc, seq_lens, block_tables, query.size(0), key_cache.size(0),
                 key_cache.size(1));

  cpu::PagedAttentionArgs args{};
  args.dtype = query.scalar_type();
  args.cache_format = format;
  args.key_scale = key_scale ? key_scale->data_ptr<float>() : nullptr;
  args.value_scale = value_scale ? value_scale->data_ptr<float>() : nullptr;
  args.out = out.data_ptr();
  args.query = query.data_ptr();
  args.key_cache = key_cache.data_ptr();
  args.value_cache = value_cache.data_ptr();
  args.query_start_loc = query_start_loc.data_ptr<int32_t>();
  args.seq_lens = seq_lens.data_ptr<int32_t>();
  args.block_tables = block_tables.data_ptr<int32_t>();
  args.out_stride = out.stride(0);
  args.query_stride = query.stride(0);
  args.num_seqs = seq_lens.numel();
  args.num_heads = num_heads;
  args.num_kv_heads = num_kv_heads;
  args.head_dim = query.size(2);
  args.block_size = key_cache.size(1);
  args.max_blocks_per_seq = block_tables.size(1);
  args.value_head_dim = out.size(2);
  args.value_row = value_cache.size(3);
  args.cache_block_stride = key_cache.stride(0);
  args.value_cache_block_stride = value_cache.stride(0);
  args.value_in_key = value_cache.data_ptr() == key_cache.data_ptr() &&
                      value_cache.sizes() == key_cache.sizes();
  args.scale = static_cast<float>(scale);
  args.sliding_window = sliding_window;
  args.logit_softcap = static_cast<float>(logit_softcap);
  args.sinks = sinks ? sinks->data_ptr<float>() : nullptr;
  if (query.size(0) == 0) return;
  cpu::paged_attention_stub.get()(args);
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("paged_attention", &paged_attention_cpu); }

}  // namespace kvserve::ops
