// Paged attention body: variable-length causal queries over a paged KV cache, online softmax in
// fp32, one work item per (sequence, kv head, query tile) so the queries of a GQA group share
// every key and value they load. Compiled once per CPU capability.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cpu_kernels.h"
#include "kernels/cpu_vec.h"

namespace kvserve::cpu {
inline namespace CPU_CAPABILITY {
namespace {

constexpr int64_t kKeyTile = 32;      // keys scored per pass of the online softmax
constexpr int64_t kRowsPerItem = 32;  // (query, head) rows that share one pass over the keys
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Scratch of one work item; reused across items run by the same thread.
struct Scratch {
  std::vector<float> q, acc, max, sum, scores, key_tile, value_tile;
  std::vector<const float*> keys, values;
  void reserve(int64_t rows, int64_t head_size) {
    q.resize(rows * head_size);
    acc.resize(rows * head_size);
    max.resize(rows);
    sum.resize(rows);
    scores.resize(kKeyTile);
    key_tile.resize(kKeyTile * head_size);
    value_tile.resize(kKeyTile * head_size);
    keys.resize(kKeyTile);
    values.resize(kKeyTile);
  }
};

// Points keys[j] / values[j] at fp32 rows for context positions [first, last); converts when the
// cache is not fp32.
template <typename T>
void gather_tile(const PagedAttentionArgs& a, const int32_t* block_table, int64_t kv_head,
                 int64_t first, int64_t last, Scratch& s) {
  const T* kc = static_cast<const T*>(a.key_cache);
  const T* vc = static_cast<const T*>(a.value_cache);
  for (int64_t j = first; j < last; ++j) {
    const int64_t block = block_table[j / a.block_size];
    const int64_t offset = block * a.cache_block_stride +
                           ((j % a.block_size) * a.num_kv_heads + kv_head) * a.head_size;
    const int64_t t = j - first;
    if constexpr (std::is_same_v<T, float>) {
      s.keys[t] = kc + offset;
      s.values[t] = vc + offset;
    } else {
      float* kd = s.key_tile.data() + t * a.head_size;
      float* vd = s.value_tile.data() + t * a.head_size;
      convert_to_float(kc + offset, kd, a.head_size);
      convert_to_float(vc + offset, vd, a.head_size);
      s.keys[t] = kd;
      s.values[t] = vd;
    }
  }
}

// Attends rows (query q_begin.., head group of kv_head) of sequence `seq` over their context.
template <typename T>
void attend_item(const PagedAttentionArgs& a, int64_t seq, int64_t kv_head, int64_t q_begin,
                 int64_t q_end, Scratch& s) {
  const int64_t d = a.head_size;
  const int64_t group = a.num_heads / a.num_kv_heads;
  const int64_t token0 = a.query_start_loc[seq];
  const int64_t query_len = a.query_start_loc[seq + 1] - token0;
  const int64_t context_len = a.seq_lens[seq];
  const int32_t* block_table = a.block_tables + seq * a.max_blocks_per_seq;
  const int64_t rows = (q_end - q_begin) * group;
  const T* query = static_cast<const T*>(a.query);

  // Row r is query q_begin + r / group, head kv_head * group + r % group. Its keys are the
  // positions [lo, hi] of the context: causal, and inside the sliding window when there is one.
  auto row_hi = [&](int64_t r) { return context_len - query_len + q_begin + r / group; };
  auto row_lo = [&](int64_t r) {
    return a.sliding_window > 0 ? std::max<int64_t>(0, row_hi(r) - a.sliding_window + 1) : 0;
  };
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t head = kv_head * group + r % group;
    convert_to_float(query + (token0 + q_begin + r / group) * a.query_stride + head * d,
                     s.q.data() + r * d, d);
    std::fill_n(s.acc.data() + r * d, d, 0.0f);
    s.max[r] = kNegInf;
    s.sum[r] = 0.0f;
  }

  const int64_t first_key = row_lo(0);
  const int64_t last_key = row_hi(rows - 1) + 1;
  for (int64_t k0 = first_key; k0 < last_key; k0 += kKeyTile) {
    const int64_t k1 = std::min(k0 + kKeyTile, last_key);
    gather_tile<T>(a, block_table, kv_head, k0, k1, s);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t lo = std::max(row_lo(r), k0), hi = std::min(row_hi(r) + 1, k1);
      if (lo >= hi) continue;
      const float* q = s.q.data() + r * d;
      float tile_max = kNegInf;
      for (int64_t j = lo; j < hi; ++j) {
        float score = dot(q, s.keys[j - k0], d) * a.scale;
        if (a.logit_softcap > 0.0f) score = a.logit_softcap * std::tanh(score / a.logit_softcap);
        s.scores[j - k0] = score;
        tile_max = std::max(tile_max, score);
      }
      const float new_max = std::max(s.max[r], tile_max);
      const float correction = std::exp(s.max[r] - new_max);  // 0 on the first tile
      float* acc = s.acc.data() + r * d;
      if (correction != 1.0f) {
        for (int64_t i = 0; i < d; ++i) acc[i] *= correction;
      }
      float tile_sum = 0.0f;
      for (int64_t j = lo; j < hi; ++j) {
        const float p = std::exp(s.scores[j - k0] - new_max);
        tile_sum += p;
        axpy(acc, p, s.values[j - k0], d);
      }
      s.sum[r] = s.sum[r] * correction + tile_sum;
      s.max[r] = new_max;
    }
  }

  T* out = static_cast<T*>(a.out);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t head = kv_head * group + r % group;
    float* acc = s.acc.data() + r * d;
    const float inv = s.sum[r] > 0.0f ? 1.0f / s.sum[r] : 0.0f;
    for (int64_t i = 0; i < d; ++i) acc[i] *= inv;
    convert_from_float(acc, out + (token0 + q_begin + r / group) * a.out_stride + head * d, d);
  }
}

void paged_attention_impl(const PagedAttentionArgs& a) {
  const int64_t group = a.num_heads / a.num_kv_heads;
  const int64_t queries_per_item = std::max<int64_t>(1, kRowsPerItem / group);
  // Work items: (sequence, kv head, query tile), flattened so that parallel_for can split them.
  std::vector<int64_t> item_start(a.num_seqs + 1, 0);
  for (int64_t b = 0; b < a.num_seqs; ++b) {
    const int64_t query_len = a.query_start_loc[b + 1] - a.query_start_loc[b];
    const int64_t tiles = (query_len + queries_per_item - 1) / queries_per_item;
    item_start[b + 1] = item_start[b] + tiles * a.num_kv_heads;
  }
  KVSERVE_DISPATCH_FLOATING(a.dtype, [&] {
    at::parallel_for(0, item_start[a.num_seqs], 1, [&](int64_t begin, int64_t end) {
      Scratch scratch;
      scratch.reserve(queries_per_item * group, a.head_size);
      int64_t seq = std::upper_bound(item_start.begin(), item_start.end(), begin) -
                    item_start.begin() - 1;
      for (int64_t item = begin; item < end; ++item) {
        while (item >= item_start[seq + 1]) ++seq;
        const int64_t local = item - item_start[seq];
        const int64_t kv_head = local % a.num_kv_heads;
        const int64_t q_begin = (local / a.num_kv_heads) * queries_per_item;
        const int64_t query_len = a.query_start_loc[seq + 1] - a.query_start_loc[seq];
        const int64_t q_end = std::min(q_begin + queries_per_item, query_len);
        attend_item<scalar_t>(a, seq, kv_head, q_begin, q_end, scratch);
      }
    });
  });
}

}  // namespace

KVSERVE_REGISTER_CPU_KERNEL(paged_attention_stub, &paged_attention_impl);

}  // namespace CPU_CAPABILITY
}  // namespace kvserve::cpu
