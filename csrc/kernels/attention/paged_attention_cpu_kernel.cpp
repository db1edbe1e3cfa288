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
// From this many rows per work item on (prefill), keys are transposed once per tile and scored a
// vector of keys at a time; below it (decode: one query x its GQA group) the transpose costs more
// than it saves, and each key is scored with one dot product.
constexpr int64_t kTransposeMinRows = 8;
constexpr int64_t kRowsPerItem = 32;  // (query, head) rows that share one pass over the keys
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Scratch of one work item; reused across items run by the same thread.
struct Scratch {
  std::vector<float> q, acc, max, sum, scores, key_t, key_tile, value_tile;
  std::vector<const float*> keys, values;
  void reserve(int64_t rows, int64_t head_size) {
    q.resize(rows * head_size);
    acc.resize(rows * head_size);
    max.resize(rows);
    sum.resize(rows);
    scores.resize(kKeyTile);
    key_t.assign(head_size * kKeyTile, 0.0f);
    key_tile.resize(kKeyTile * head_size);
    value_tile.resize(kKeyTile * head_size);
    keys.resize(kKeyTile);
    values.resize(kKeyTile);
  }
};

// For context positions [first, last): values[j] pointing at fp32 value rows, and either the
// keys transposed to fp32 key_t [head_size, kKeyTile] (`transposed`: scores are then computed a
// vector of keys at a time, with no horizontal sums) or keys[j] pointing at fp32 key rows.
// Rows are converted when the cache is not fp32.
template <typename T>
void gather_tile(const PagedAttentionArgs& a, const int32_t* block_table, int64_t kv_head,
                 int64_t first, int64_t last, bool transposed, Scratch& s) {
  const T* kc = static_cast<const T*>(a.key_cache);
  const T* vc = static_cast<const T*>(a.value_cache);
  for (int64_t j = first; j < last; ++j) {
    const int64_t block = block_table[j / a.block_size];
    const int64_t offset = block * a.cache_block_stride +
                           ((j % a.block_size) * a.num_kv_heads + kv_head) * a.head_size;
    const int64_t t = j - first;
    const T* key = kc + offset;
    if (transposed) {
      for (int64_t d = 0; d < a.head_size; ++d) {
        s.key_t[d * kKeyTile + t] = static_cast<float>(key[d]);
      }
    }
    if constexpr (std::is_same_v<T, float>) {
      s.keys[t] = key;
      s.values[t] = vc + offset;
    } else {
      float* vd = s.value_tile.data() + t * a.head_size;
      convert_to_float(vc + offset, vd, a.head_size);
      s.values[t] = vd;
      if (!transposed) {
        float* kd = s.key_tile.data() + t * a.head_size;
        convert_to_float(key, kd, a.head_size);
        s.keys[t] = kd;
      }
    }
  }
}

// scores[t] = q . key_t[:, t] for the whole tile, vectorized over keys.
void score_tile(const float* q, const float* key_t, int64_t head_size, float* scores) {
  constexpr int64_t kVecs = kKeyTile / Vec::size();
  Vec acc[kVecs];
  for (int64_t v = 0; v < kVecs; ++v) acc[v] = Vec(0.0f);
  for (int64_t d = 0; d < head_size; ++d) {
    const Vec qd(q[d]);
    for (int64_t v = 0; v < kVecs; ++v) {
      acc[v] = at::vec::fmadd(qd, Vec::loadu(key_t + d * kKeyTile + v * Vec::size()), acc[v]);
    }
  }
  for (int64_t v = 0; v < kVecs; ++v) acc[v].store(scores + v * Vec::size());
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

  const bool transposed = rows >= kTransposeMinRows;
  const Vec scale(a.scale), cap(a.logit_softcap), inv_cap(1.0f / a.logit_softcap);
  const int64_t first_key = row_lo(0);
  const int64_t last_key = row_hi(rows - 1) + 1;
  for (int64_t k0 = first_key; k0 < last_key; k0 += kKeyTile) {
    const int64_t k1 = std::min(k0 + kKeyTile, last_key);
    gather_tile<T>(a, block_table, kv_head, k0, k1, transposed, s);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t lo = std::max(row_lo(r), k0) - k0, hi = std::min(row_hi(r) + 1, k1) - k0;
      if (lo >= hi) continue;
      float* scores = s.scores.data();
      const float* q = s.q.data() + r * d;
      if (transposed) {
        score_tile(q, s.key_t.data(), d, scores);
      } else {
        for (int64_t j = lo; j < hi; ++j) scores[j] = dot(q, s.keys[j], d);
      }
      for (int64_t j = 0; j < kKeyTile; j += Vec::size()) {
        Vec x = Vec::loadu(scores + j) * scale;
        if (a.logit_softcap > 0.0f) x = cap * (x * inv_cap).tanh();
        x.store(scores + j);
      }
      // Keys outside this row's range (and tile columns past the context) take no weight.
      std::fill(scores, scores + lo, kNegInf);
      std::fill(scores + hi, scores + kKeyTile, kNegInf);
      const float tile_max = *std::max_element(scores + lo, scores + hi);
      const float new_max = std::max(s.max[r], tile_max);
      const float correction = std::exp(s.max[r] - new_max);  // 0 on the first tile
      float* acc = s.acc.data() + r * d;
      if (correction != 1.0f) {
        for (int64_t i = 0; i < d; ++i) acc[i] *= correction;
      }
      const Vec shift(new_max);
      Vec sum(0.0f);
      for (int64_t j = 0; j < kKeyTile; j += Vec::size()) {
        const Vec p = (Vec::loadu(scores + j) - shift).exp();
        p.store(scores + j);
        sum = sum + p;
      }
      for (int64_t j = lo; j < hi; ++j) axpy(acc, scores[j], s.values[j], d);
      s.sum[r] = s.sum[r] * correction +
                 at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, sum);
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
