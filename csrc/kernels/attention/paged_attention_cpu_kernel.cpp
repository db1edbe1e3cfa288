// Paged attention body: variable-length causal queries over a paged KV cache, online softmax in
// fp32. A work item is (sequence, kv head, block of queries): its rows are those queries times
// the query heads of the GQA group, so all of them share every key and value it loads. Items of
// few rows (decode) may take several KV heads of their sequence.
// Compiled once per CPU capability.
//
// Two paths, chosen per item from its own sizes only (so a sequence's rows do not depend on the
// rest of the batch):
//  * few rows (decode, short chunks): register-blocked dot products of a few rows against a few
//    keys, over a tile copied from the cache in address order
//    (paged_attention_decode_cpu_kernel.cpp);
//  * many rows (prefill): flash-attention style tiles (paged_attention_prefill_cpu_kernel.cpp).
// paged_attention_cpu_kernel.h declares what they share. This file makes the work items,
// schedules them over threads and registers the kernel.
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "kernels/attention/paged_attention_cpu_kernel.h"

namespace kvserve::cpu {
inline namespace CPU_CAPABILITY {
namespace paged_attention {
namespace {

constexpr int64_t kRowsPerItem = 64;   // target (query, head) rows per work item
// Decode items are sized so that each thread gets at least this many (load balance).
constexpr int64_t kItemsPerThread = 4;

// Items of every sequence, most expensive first: threads take the next one as they finish, so a
// causal prefill (whose late query blocks see more keys) or a thread slowed by a neighbouring
// process does not leave the others idle. Items of few rows per KV head (decode) take several KV
// heads of their sequence when there are enough of them to keep every thread busy.
std::vector<Item> make_items(const PagedAttentionArgs& a, int64_t queries_per_item,
                             int64_t threads) {
  const int64_t group = a.num_heads / a.num_kv_heads;
  int64_t few_row_runs = 0;  // (sequence, query block) pairs on the dot-product path
  for (int64_t b = 0; b < a.num_seqs; ++b) {
    const int64_t query_len = a.query_start_loc[b + 1] - a.query_start_loc[b];
    if (query_len > 0 && query_len * group < kTiledMinRows) ++few_row_runs;
  }
  const int64_t heads_per_item = std::clamp<int64_t>(
      few_row_runs * a.num_kv_heads / (kItemsPerThread * threads), 1, a.num_kv_heads);
  std::vector<Item> items;
  for (int64_t b = 0; b < a.num_seqs; ++b) {
    const int64_t query_len = a.query_start_loc[b + 1] - a.query_start_loc[b];
    for (int64_t q0 = 0; q0 < query_len; q0 += queries_per_item) {
      const int64_t q1 = std::min(q0 + queries_per_item, query_len);
      const int64_t hi = a.seq_lens[b] - query_len + q1;
      const int64_t lo = a.sliding_window > 0
                             ? std::max<int64_t>(0, a.seq_lens[b] - query_len + q0 -
                                                        a.sliding_window + 1)
                             : 0;
      const int64_t step = (q1 - q0) * group < kTiledMinRows ? heads_per_item : 1;
      for (int64_t h = 0; h < a.num_kv_heads; h += step) {
        const int64_t h1 = std::min(h + step, a.num_kv_heads);
        items.push_back({b, h, h1, q0, q1, (h1 - h) * (q1 - q0) * group * (hi - lo + kKeyTile)});
      }
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& x, const Item& y) { return x.cost > y.cost; });
  return items;
}

void paged_attention_impl(const PagedAttentionArgs& a) {
  const int64_t group = a.num_heads / a.num_kv_heads;
  const int64_t queries_per_item = std::max<int64_t>(1, kRowsPerItem / group);
  const int64_t threads = at::get_num_threads();
  const std::vector<Item> items = make_items(a, queries_per_item, threads);
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::min<int64_t>(threads, num_items);
  // Rows of a tiled item, or of a dot-product item of all KV heads.
  const int64_t max_rows =
      std::max(queries_per_item * group, (kTiledMinRows - 1) * a.num_kv_heads);
  std::atomic<int64_t> next{0};
  KVSERVE_DISPATCH_FLOATING(a.dtype, [&] {
    at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
      thread_local Scratch scratch;
      scratch.reserve(max_rows, a.head_dim, a.value_head_dim, a.num_kv_heads);
      for (int64_t i = next++; i < num_items; i = next++) {
        const Item& it = items[i];
        if ((it.q_end - it.q_begin) * group >= kTiledMinRows) {
          attend_tiled<scalar_t>(a, it, scratch);
        } else {
          attend_rows<scalar_t>(a, it, scratch);
        }
      }
    });
  });
}

}  // namespace
}  // namespace paged_attention

KVSERVE_REGISTER_CPU_KERNEL(paged_attention_stub, &paged_attention::paged_attention_impl);

}  // namespace CPU_CAPABILITY
}  // namespace kvserve::cpu
