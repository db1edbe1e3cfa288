#pragma once
// What the paged attention kernel files share (include only from them; compiled once per CPU
// capability): the work item, the view of its sequence, the scratch of a thread, and the two
// paths that attend an item. The scheme is described in paged_attention_cpu_kernel.cpp.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels/cpu_kernels.h"
#include "kernels/cpu_vec.h"

namespace kvserve::cpu {
inline namespace CPU_CAPABILITY {
namespace paged_attention {

constexpr int64_t kKeyTile = 64;       // keys per pass of the online softmax
// From this many rows on an item takes the tiled path; below it, rows are padded to whole vectors
// for too little reuse, and a dot product per (row, key) is cheaper.
constexpr int64_t kTiledMinRows = 8;
constexpr int kPrefetchLocality = 2;   // __builtin_prefetch: 3 = all levels (t0), 2 = L2 (t1)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/// What a row's accumulated values are multiplied by once its keys are done (running max `max`,
/// sum of exp(score - max) `sum`): 1 / sum; with a sink logit (gpt-oss; sinks null: none) for
/// the row's query head, the sink joins the softmax's denominator as exp(sink - max), computed
/// against max(max, sink) so that neither side overflows. A row without keys gets 0.
inline float softmax_normalizer(float max, float sum, const float* sinks, int64_t head) {
  if (!(sum > 0.0f)) return 0.0f;
  if (!sinks) return 1.0f / sum;
  const float top = std::max(max, sinks[head]);
  const float kept = std::exp(max - top);
  return kept / (sum * kept + std::exp(sinks[head] - top));
}

/// One work item: rows of queries [q_begin, q_end) of `seq` for the query heads of the groups of
/// KV heads [kv_head, kv_head_end) (one KV head on the tiled path).
struct Item {
  int64_t seq, kv_head, kv_head_end, q_begin, q_end, cost;
};

/// The sequence of an item: where its queries are, its block table, and the positions each of its
/// queries sees (causal, within the sliding window).
struct SeqView {
  int64_t token0, query_len, context_len;
  const int32_t* block_table;
  int64_t sliding_window;
  SeqView(const PagedAttentionArgs& a, int64_t seq)
      : token0(a.query_start_loc[seq]),
        query_len(a.query_start_loc[seq + 1] - token0),
        context_len(a.seq_lens[seq]),
        block_table(a.block_tables + seq * a.max_blocks_per_seq),
        sliding_window(a.sliding_window) {}
  /// Last and first position that query i (of the sequence's run) attends to.
  int64_t hi(int64_t i) const { return context_len - query_len + i; }
  int64_t lo(int64_t i) const {
    return sliding_window > 0 ? std::max<int64_t>(0, hi(i) - sliding_window + 1) : 0;
  }
};

/// Cache lines to hint into the cache a few at a time, between the micro-kernel passes of the
/// work that precedes their use: a burst of hints stalls like the loads it replaces (each takes a
/// miss buffer until its line arrives), while hints spread over computation overlap with it.
/// The lines are kept as runs of contiguous memory (a block's slots), not one by one: listing
/// and walking them must cost little next to the computation they overlap with.
struct LinePrefetcher {
  struct Run {
    const char* first_line;  // 64-byte aligned
    int64_t lines;
  };
  std::vector<Run> runs;
  int64_t total = 0, per_step = 0, run = 0, line = 0;
  void clear() {
    runs.clear();
    total = 0;
  }
  // The lines holding bytes [begin, begin + bytes).
  void add(const char* begin, int64_t bytes) {
    const auto address = reinterpret_cast<uintptr_t>(begin);
    const uintptr_t first = address & ~uintptr_t{63};
    const int64_t lines = static_cast<int64_t>((address + bytes - first + 63) / 64);
    runs.push_back({reinterpret_cast<const char*>(first), lines});
    total += lines;
  }
  // Spreads the lines over about `steps` calls of step().
  void start(int64_t steps) {
    run = line = 0;
    per_step = (total + std::max<int64_t>(steps, 1) - 1) / std::max<int64_t>(steps, 1);
  }
  void step() {
    for (int64_t left = per_step; left > 0 && run < static_cast<int64_t>(runs.size());) {
      const Run& r = runs[run];
      const int64_t end = std::min(r.lines, line + left);
      for (int64_t i = line; i < end; ++i) {
        __builtin_prefetch(r.first_line + i * 64, 0, kPrefetchLocality);
      }
      left -= end - line;
      line = end;
      if (line == r.lines) {
        ++run;
        line = 0;
      }
    }
  }
  void finish() {
    per_step = total;
    step();
  }
};

/// Cache offsets (elements) of position j's row of KV head h, in the key and the value cache.
inline int64_t key_offset(const PagedAttentionArgs& a, const int32_t* block_table, int64_t j,
                          int64_t h) {
  return block_table[j / a.block_size] * a.cache_block_stride +
         ((j % a.block_size) * a.num_kv_heads + h) * a.head_dim;
}
inline int64_t value_offset(const PagedAttentionArgs& a, const int32_t* block_table, int64_t j,
                            int64_t h) {
  return block_table[j / a.block_size] * a.value_cache_block_stride +
         ((j % a.block_size) * a.num_kv_heads + h) * a.value_row;
}

/// Converts n entries of the cache row at element `offset` of `cache` (the key or the value
/// cache; `row` elements per row, so that offset / row is the row's scale index) to fp32: a
/// plain cache holds T, a quantized one int8 or fp8 entries times the row's scale.
template <typename T>
inline void load_cache_row(const PagedAttentionArgs& a, const void* cache, const float* scales,
                           int64_t offset, int64_t row, float* dst, int64_t n) {
  switch (a.cache_format) {
    case KVCacheFormat::kPlain:
      convert_to_float(static_cast<const T*>(cache) + offset, dst, n);
      break;
    case KVCacheFormat::kInt8:
      dequantize_int8(static_cast<const int8_t*>(cache) + offset, scales[offset / row], dst, n);
      break;
    case KVCacheFormat::kFp8E4M3:
      dequantize_fp8_e4m3(static_cast<const uint8_t*>(cache) + offset, scales[offset / row], dst,
                          n);
      break;
  }
}

/// A position's key / value row of a KV head to fp32 (the first n entries).
template <typename T>
inline void load_key(const PagedAttentionArgs& a, int64_t offset, float* dst, int64_t n) {
  load_cache_row<T>(a, a.key_cache, a.key_scale, offset, a.head_dim, dst, n);
}
template <typename T>
inline void load_value(const PagedAttentionArgs& a, int64_t offset, float* dst, int64_t n) {
  load_cache_row<T>(a, a.value_cache, a.value_scale, offset, a.value_row, dst, n);
}

/// Scratch of one thread, reused across its items and across calls (thread-local): reserve()
/// only grows it, so a call neither allocates nor clears half a MiB per thread. Entries hold
/// whatever an earlier item wrote; every path writes what it reads (the dot-product path zeroes
/// its rows' padding columns itself).
struct Scratch {
  std::vector<float> q, acc, max, sum, corr, lo, hi, scores, key_rows, value_rows;
  std::vector<const float*> keys, values;
  std::vector<int64_t> slots;  // a tile's key cache offsets (elements) of its first KV head's rows
  std::vector<int64_t> value_slots;  // the same in the value cache
  LinePrefetcher prefetch;
  void reserve(int64_t rows, int64_t head_dim, int64_t value_head_dim, int64_t num_kv_heads) {
    const int64_t mp = round_up(rows, Vec::size()), dp = round_up(head_dim, Vec::size());
    const int64_t dvp = round_up(value_head_dim, Vec::size());
    // The dot-product path keeps rows [rows, dp] / [rows, dvp] and scores
    // [rows, kKeyTile + Vec::size()].
    q.resize(mp * dp);
    acc.resize(mp * dvp);
    for (auto* v : {&max, &sum, &corr, &lo, &hi}) v->resize(mp);
    scores.resize(mp * (kKeyTile + Vec::size()));
    // The tiled path keeps [kKeyTile, head_dim] / [kKeyTile, dp] rows of one head; the dot-product
    // path [num_kv_heads, kKeyTile, dp].
    grow(key_rows, kKeyTile * num_kv_heads * dp);
    grow(value_rows, kKeyTile * num_kv_heads * dvp);
    keys.resize(kKeyTile + Vec::size());  // the dot-product path pads a tile to whole passes
    values.resize(kKeyTile);
    slots.resize(kKeyTile);
    value_slots.resize(kKeyTile);
  }

 private:
  static void grow(std::vector<float>& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  }
};

/// Attends an item of at least kTiledMinRows rows (one KV head) with flash-attention style
/// tiles: paged_attention_prefill_cpu_kernel.cpp. Instantiated for float, BFloat16 and Half.
template <typename T>
void attend_tiled(const PagedAttentionArgs& a, const Item& it, Scratch& s);

/// Attends an item of fewer than kTiledMinRows rows per KV head, for one or several KV heads of
/// a sequence, with register-blocked dot products: paged_attention_decode_cpu_kernel.cpp.
/// Instantiated for float, BFloat16 and Half.
template <typename T>
void attend_rows(const PagedAttentionArgs& a, const Item& it, Scratch& s);

}  // namespace paged_attention
}  // namespace CPU_CAPABILITY
}  // namespace kvserve::cpu
