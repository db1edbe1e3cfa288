// Paged attention body: variable-length causal queries over a paged KV cache, online softmax in
// fp32. A work item is (sequence, kv head, block of queries): its rows are those queries times
// the query heads of the GQA group, so all of them share every key and value it loads. Items of
// few rows (decode) may take several KV heads of their sequence.
// Compiled once per CPU capability.
//
// Two paths, chosen per item from its own sizes only (so a sequence's rows do not depend on the
// rest of the batch):
//  * few rows (decode, short chunks): register-blocked dot products of a few rows against a few
//    keys, over a tile copied from the cache in address order;
//  * many rows (prefill): flash-attention style tiles. The item's queries are transposed once to
//    q_t [head_size, rows], so the scores of a key tile, S^T [keys, rows], come from a register-
//    blocked micro-kernel that broadcasts key elements against vectors of rows, and the online
//    softmax runs a vector of rows at a time (no horizontal sums); O [rows, head_size] += P V with
//    a second micro-kernel.
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cpu_kernels.h"
#include "kernels/cpu_vec.h"

namespace kvserve::cpu {
inline namespace CPU_CAPABILITY {
namespace {

constexpr int64_t kKeyTile = 64;       // keys per pass of the online softmax
constexpr int64_t kRowsPerItem = 64;   // target (query, head) rows per work item
// From this many rows on an item takes the tiled path; below it, rows are padded to whole vectors
// for too little reuse, and a dot product per (row, key) is cheaper.
constexpr int64_t kTiledMinRows = 8;
// Decode items are sized so that each thread gets at least this many (load balance).
constexpr int64_t kItemsPerThread = 4;
constexpr int kPrefetchLocality = 2;   // __builtin_prefetch: 3 = all levels (t0), 2 = L2 (t1)
constexpr int kScoreKeys = 4;          // score micro-kernel: keys x vectors of rows in registers
constexpr int kPvRows = 4;             // P V micro-kernel: rows x vectors of head_size
constexpr int kVecsPerBlock = 2;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

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

// Cache lines to hint into the cache a few at a time, between the micro-kernel passes of the
// work that precedes their use: a burst of hints stalls like the loads it replaces (each takes a
// miss buffer until its line arrives), while hints spread over computation overlap with it.
// The lines are kept as runs of contiguous memory (a block's slots), not one by one: listing
// and walking them must cost little next to the computation they overlap with.
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

// Scratch of one thread, reused across its items.
struct Scratch {
  std::vector<float> q, acc, max, sum, corr, lo, hi, scores, key_rows, value_rows;
  std::vector<const float*> keys, values;
  std::vector<int64_t> slots;  // a tile's cache offsets (elements) of its first KV head's rows
  LinePrefetcher prefetch;
  void reserve(int64_t rows, int64_t head_size, int64_t num_kv_heads) {
    const int64_t mp = round_up(rows, Vec::size()), dp = round_up(head_size, Vec::size());
    // The dot-product path keeps rows [rows, dp] and scores [rows, kKeyTile + Vec::size()].
    q.resize(mp * dp);
    acc.resize(mp * dp);
    for (auto* v : {&max, &sum, &corr, &lo, &hi}) v->resize(mp);
    scores.resize(mp * (kKeyTile + Vec::size()));
    // The tiled path keeps [kKeyTile, head_size] / [kKeyTile, dp] rows of one head; the dot-product
    // path [num_kv_heads, kKeyTile, dp] (zero padding).
    key_rows.assign(kKeyTile * num_kv_heads * dp, 0.0f);
    value_rows.assign(kKeyTile * num_kv_heads * dp, 0.0f);
    keys.resize(kKeyTile + Vec::size());  // the dot-product path pads a tile to whole passes
    values.resize(kKeyTile);
    slots.resize(kKeyTile);
  }
};

// Calls f(position, offset, count) for the runs of positions [first, last) that share a block:
// offset is the cache offset (elements) of position's slot, and the next count - 1 slots follow
// it at a stride of one slot.
template <typename F>
void for_block_runs(const PagedAttentionArgs& a, const int32_t* block_table, int64_t first,
                    int64_t last, F&& f) {
  const int64_t slot = a.num_kv_heads * a.head_size;
  for (int64_t j = first; j < last;) {
    const int64_t in_block = j % a.block_size;
    const int64_t count = std::min(last - j, a.block_size - in_block);
    f(j, block_table[j / a.block_size] * a.cache_block_stride + in_block * slot, count);
    j += count;
  }
}

// keys[t], values[t]: fp32 copies of the rows of context positions [first, last) in key_rows
// [kKeyTile, head_size] / value_rows [kKeyTile, value_stride] (columns past head_size are never
// output, so what lies there does not matter). Copied even when the cache is fp32: in place, the
// rows of a block sit num_kv_heads * head_size apart (4 KiB for 8 heads of 128 floats), so a
// tile's rows would fight over a few L1 sets.
template <typename T>
void load_rows(const PagedAttentionArgs& a, const int32_t* block_table, int64_t kv_head,
               int64_t first, int64_t last, int64_t value_stride, Scratch& s) {
  const T* kc = static_cast<const T*>(a.key_cache);
  const T* vc = static_cast<const T*>(a.value_cache);
  const int64_t d = a.head_size;
  for (int64_t j = first; j < last; ++j) {
    const int64_t offset = block_table[j / a.block_size] * a.cache_block_stride +
                           ((j % a.block_size) * a.num_kv_heads + kv_head) * d;
    const int64_t t = j - first;
    convert_to_float(kc + offset, s.key_rows.data() + t * d, d);
    s.keys[t] = s.key_rows.data() + t * d;
    convert_to_float(vc + offset, s.value_rows.data() + t * value_stride, d);
    s.values[t] = s.value_rows.data() + t * value_stride;
  }
}

// Copies the rows of KV heads [kv_head, kv_head_end) at positions [first, last) to key_rows /
// value_rows as fp32 [head, kKeyTile, dp] (columns past head_size stay 0). The heads of a position
// are adjacent in the cache and the positions of a block too, so this reads whole runs of memory
// in address order, which the hardware prefetchers follow; reading one head's rows in place
// instead touches a few lines of every slot and runs at a fraction of the memory bandwidth.
template <typename T>
void gather_tile(const PagedAttentionArgs& a, const int32_t* block_table, int64_t kv_head,
                 int64_t kv_head_end, int64_t first, int64_t last, int64_t dp, Scratch& s) {
  const T* kc = static_cast<const T*>(a.key_cache);
  const T* vc = static_cast<const T*>(a.value_cache);
  const int64_t d = a.head_size, slot = a.num_kv_heads * d;
  for_block_runs(a, block_table, first, last, [&](int64_t j0, int64_t offset, int64_t count) {
    for (int64_t c = 0; c < count; ++c) {
      const int64_t j = j0 + c, at = offset + c * slot + kv_head * d;
      for (int64_t h = 0; h < kv_head_end - kv_head; ++h) {
        const int64_t row = (h * kKeyTile + j - first) * dp;
        convert_to_float(kc + at + h * d, s.key_rows.data() + row, d);
        convert_to_float(vc + at + h * d, s.value_rows.data() + row, d);
      }
    }
  });
}

// ------------------------------------------------------------------------------- tiled path

// scores[k, c] = keys[k] . q_t[:, c] for NK keys and C vectors of rows (q_t [d, mp], scores
// [*, mp]).
template <int NK, int C>
void score_block(const float* const* keys, const float* q_t, int64_t mp, int64_t d,
                 float* scores) {
  Vec acc[NK][C];
  for (int k = 0; k < NK; ++k)
    for (int c = 0; c < C; ++c) acc[k][c] = Vec(0.0f);
  for (int64_t i = 0; i < d; ++i) {
    Vec q[C];
    for (int c = 0; c < C; ++c) q[c] = Vec::loadu(q_t + i * mp + c * Vec::size());
    for (int k = 0; k < NK; ++k) {
      const Vec key(keys[k][i]);
      for (int c = 0; c < C; ++c) acc[k][c] = at::vec::fmadd(key, q[c], acc[k][c]);
    }
  }
  for (int k = 0; k < NK; ++k)
    for (int c = 0; c < C; ++c) acc[k][c].store(scores + k * mp + c * Vec::size());
}

template <int NK>
void score_keys(const float* const* keys, const float* q_t, int64_t mp, int64_t d, float* scores) {
  int64_t c = 0;
  for (; c + kVecsPerBlock * Vec::size() <= mp; c += kVecsPerBlock * Vec::size()) {
    score_block<NK, kVecsPerBlock>(keys, q_t + c, mp, d, scores + c);
  }
  for (; c < mp; c += Vec::size()) score_block<NK, 1>(keys, q_t + c, mp, d, scores + c);
}

// scores [n, mp] = keys[0..n) . q_t.
void score_tile(const float* const* keys, int64_t n, const float* q_t, int64_t mp, int64_t d,
                float* scores) {
  int64_t k = 0;
  for (; k + kScoreKeys <= n; k += kScoreKeys) {
    score_keys<kScoreKeys>(keys + k, q_t, mp, d, scores + k * mp);
  }
  for (; k < n; ++k) score_keys<1>(keys + k, q_t, mp, d, scores + k * mp);
}

// acc[r, col..] += sum_t probs[t, r] * values[t][col..] for R rows and C vectors of columns.
template <int R, int C>
void pv_block(const float* probs, int64_t mp, const float* const* values, int64_t col, int64_t n,
              float* acc, int64_t dp) {
  Vec o[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) o[r][c] = Vec::loadu(acc + r * dp + col + c * Vec::size());
  for (int64_t t = 0; t < n; ++t) {
    Vec v[C];
    for (int c = 0; c < C; ++c) v[c] = Vec::loadu(values[t] + col + c * Vec::size());
    for (int r = 0; r < R; ++r) {
      const Vec p(probs[t * mp + r]);
      for (int c = 0; c < C; ++c) o[r][c] = at::vec::fmadd(p, v[c], o[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) o[r][c].store(acc + r * dp + col + c * Vec::size());
}

// acc [mp, dp] += probs^T [mp, n] values [n, dp]; mp is a multiple of kPvRows.
void pv_tile(const float* probs, int64_t mp, const float* const* values, int64_t n, float* acc,
             int64_t dp) {
  for (int64_t r = 0; r < mp; r += kPvRows) {
    int64_t col = 0;
    for (; col + kVecsPerBlock * Vec::size() <= dp; col += kVecsPerBlock * Vec::size()) {
      pv_block<kPvRows, kVecsPerBlock>(probs + r, mp, values, col, n, acc + r * dp, dp);
    }
    for (; col < dp; col += Vec::size()) {
      pv_block<kPvRows, 1>(probs + r, mp, values, col, n, acc + r * dp, dp);
    }
  }
}

// Online softmax over one tile of scores [n, mp] (keys k0..k0+n) for every vector of rows:
// scale, soft-cap, mask (positions outside [lo, hi] of the row), then scores become
// probabilities relative to the running max, and corr the factor the row's accumulator needs.
void softmax_tile(const PagedAttentionArgs& a, int64_t k0, int64_t n, int64_t mp, bool masked,
                  Scratch& s) {
  const Vec scale(a.scale), cap(a.logit_softcap), inv_cap(1.0f / a.logit_softcap);
  const Vec neg_inf(kNegInf), zero(0.0f);
  for (int64_t c = 0; c < mp; c += Vec::size()) {
    const Vec lo = Vec::loadu(s.lo.data() + c), hi = Vec::loadu(s.hi.data() + c);
    Vec tile_max = neg_inf;
    for (int64_t t = 0; t < n; ++t) {
      float* x_ptr = s.scores.data() + t * mp + c;
      Vec x = Vec::loadu(x_ptr) * scale;
      if (a.logit_softcap > 0.0f) x = cap * (x * inv_cap).tanh();
      if (masked) {
        const Vec pos(static_cast<float>(k0 + t));
        x = Vec::blendv(x, neg_inf, (pos > hi) | (pos < lo));
      }
      x.store(x_ptr);
      tile_max = at::vec::maximum(tile_max, x);
    }
    const Vec old_max = Vec::loadu(s.max.data() + c);
    const Vec new_max = at::vec::maximum(old_max, tile_max);
    // A row with no key yet keeps max -inf; shifting by 0 then gives it probabilities 0.
    const Vec shift = Vec::blendv(new_max, zero, new_max == neg_inf);
    Vec sum = zero;
    for (int64_t t = 0; t < n; ++t) {
      float* x_ptr = s.scores.data() + t * mp + c;
      const Vec p = (Vec::loadu(x_ptr) - shift).exp();
      p.store(x_ptr);
      sum = sum + p;
    }
    const Vec corr = (old_max - shift).exp();  // 0 while the row had no key
    (Vec::loadu(s.sum.data() + c) * corr + sum).store(s.sum.data() + c);
    new_max.store(s.max.data() + c);
    corr.store(s.corr.data() + c);
  }
}

template <typename T>
void attend_tiled(const PagedAttentionArgs& a, const Item& it, Scratch& s) {
  const int64_t d = a.head_size, dp = round_up(d, Vec::size());
  const int64_t group = a.num_heads / a.num_kv_heads;
  const SeqView seq(a, it.seq);
  const int64_t token0 = seq.token0;
  const int32_t* block_table = seq.block_table;
  const int64_t rows = (it.q_end - it.q_begin) * group;
  const int64_t mp = round_up(rows, Vec::size());
  const T* query = static_cast<const T*>(a.query);

  // Row r is query q_begin + r / group, head kv_head * group + r % group; it sees positions
  // [lo, hi]. Padding rows up to mp repeat the last row (finite, discarded).
  auto row_hi = [&](int64_t r) { return seq.hi(it.q_begin + r / group); };
  auto row_lo = [&](int64_t r) { return seq.lo(it.q_begin + r / group); };
  for (int64_t r = 0; r < mp; ++r) {
    const int64_t src = std::min(r, rows - 1);
    const T* q = query + (token0 + it.q_begin + src / group) * a.query_stride +
                 (it.kv_head * group + src % group) * d;
    for (int64_t i = 0; i < d; ++i) s.q[i * mp + r] = static_cast<float>(q[i]);
    s.lo[r] = static_cast<float>(row_lo(src));
    s.hi[r] = static_cast<float>(row_hi(src));
    s.max[r] = kNegInf;
    s.sum[r] = 0.0f;
  }
  std::fill_n(s.acc.data(), mp * dp, 0.0f);

  const int64_t first_key = row_lo(0), last_key = row_hi(rows - 1) + 1;
  const int64_t all_from = row_lo(rows - 1), all_to = row_hi(0);  // keys every row sees
  for (int64_t k0 = first_key; k0 < last_key; k0 += kKeyTile) {
    const int64_t n = std::min(k0 + kKeyTile, last_key) - k0;
    load_rows<T>(a, block_table, it.kv_head, k0, k0 + n, dp, s);
    score_tile(s.keys.data(), n, s.q.data(), mp, d, s.scores.data());
    softmax_tile(a, k0, n, mp, k0 < all_from || k0 + n - 1 > all_to, s);
    for (int64_t r = 0; r < mp; ++r) {
      const float corr = s.corr[r];
      if (corr == 1.0f) continue;
      float* acc = s.acc.data() + r * dp;
      for (int64_t i = 0; i < dp; i += Vec::size()) (Vec::loadu(acc + i) * Vec(corr)).store(acc + i);
    }
    pv_tile(s.scores.data(), mp, s.values.data(), n, s.acc.data(), dp);
  }

  T* out = static_cast<T*>(a.out);
  for (int64_t r = 0; r < rows; ++r) {
    float* acc = s.acc.data() + r * dp;
    const float inv = s.sum[r] > 0.0f ? 1.0f / s.sum[r] : 0.0f;
    for (int64_t i = 0; i < d; ++i) acc[i] *= inv;
    convert_from_float(acc, out + (token0 + it.q_begin + r / group) * a.out_stride +
                                (it.kv_head * group + r % group) * d, d);
  }
}

// ------------------------------------------------------------------------- dot-product path
//
// Rows go in blocks of R (4, 2 or 1) that share every key and value load, and Vec::size()
// vector accumulators per pass (R rows x Vec::size() / R keys or columns; half the registers of
// AVX2 and AVX512 alike). Scores accumulate vertically over head_size and are reduced to one
// vector of Vec::size() scores at the end of the pass; P V keeps a block of each row's output in
// registers across the tile, so the accumulator in memory is touched once per tile, not per key.

constexpr int64_t kScoreStride = kKeyTile + Vec::size();  // a row's scores, with pass padding

// Lane j of the result is the sum of v[j]'s lanes (v [N], N = Vec::size(), clobbered). Each level
// halves the vectors: deinterleaving a pair and adding gives the pairwise sums of the first in
// the low half and of the second in the high half, so the order stays natural.
template <int N>
inline Vec reduce_lanes(Vec* v) {
  if constexpr (N == 1) {
    return v[0];
  } else {
#pragma GCC unroll 16
    for (int i = 0; i < N / 2; ++i) {
      const auto [even, odd] = at::vec::deinterleave2(v[2 * i], v[2 * i + 1]);
      v[i] = even + odd;
    }
    return reduce_lanes<N / 2>(v);
  }
}

// Loads x[0, count) as a vector, count <= Vec::size(); lanes past count are 0 and memory past it
// is never read (a row's tail may be followed by a poisoned slot or the end of the cache).
template <bool kPart>
inline Vec load_row(const float* x, int64_t count) {
  if constexpr (kPart) {
    return Vec::loadu(x, count);
  } else {
    return Vec::loadu(x);
  }
}

// scores[r * kScoreStride + k] = q[r] . keys[k] for R rows (q [R, dp], zero past d) and
// Vec::size() / R keys of d floats.
template <int R>
void score_rows(const float* q, const float* const* keys, int64_t d, int64_t dp, float* scores) {
  constexpr int K = Vec::size() / R;
  Vec acc[R * K];
#pragma GCC unroll 16
  for (int j = 0; j < R * K; ++j) acc[j] = Vec(0.0f);
  const float* key[K];
#pragma GCC unroll 16
  for (int k = 0; k < K; ++k) key[k] = keys[k];
  auto chunk = [&]<bool kPart>(int64_t i) {
    Vec qr[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) qr[r] = Vec::loadu(q + r * dp + i);
#pragma GCC unroll 16
    for (int k = 0; k < K; ++k) {
      const Vec kv = load_row<kPart>(key[k] + i, d - i);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) acc[r * K + k] = at::vec::fmadd(qr[r], kv, acc[r * K + k]);
    }
  };
  int64_t i = 0;
  for (; i + Vec::size() <= d; i += Vec::size()) chunk.template operator()<false>(i);
  if (i < d) chunk.template operator()<true>(i);
  alignas(64) float sums[Vec::size()];
  reduce_lanes<Vec::size()>(acc).store(sums);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int k = 0; k < K; ++k) scores[r * kScoreStride + k] = sums[r * K + k];
}

// acc[r, col..] = acc[r, col..] * corr[r] + sum_t probs[r, t] * values[t][col..] for R rows and
// C vectors of columns (probs [R, kScoreStride], acc [R, dp]); with kPart the last vector holds
// only `last` columns of the value rows.
template <int R, int C, bool kPart>
void pv_rows(const float* probs, const float* corr, const float* const* values, int64_t n,
             int64_t col, int64_t last, float* acc, int64_t dp) {
  Vec o[R][C];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c)
      o[r][c] = Vec::loadu(acc + r * dp + col + c * Vec::size()) * Vec(corr[r]);
  for (int64_t t = 0; t < n; ++t) {
    Vec v[C];
    const float* value = values[t] + col;
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) {
      v[c] = c == C - 1 ? load_row<kPart>(value + c * Vec::size(), last)
                        : Vec::loadu(value + c * Vec::size());
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const Vec p(probs[r * kScoreStride + t]);
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) o[r][c] = at::vec::fmadd(p, v[c], o[r][c]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) o[r][c].store(acc + r * dp + col + c * Vec::size());
}

// Scores, then P V, of one tile (n keys; keys[] padded to whole passes) for rows [r0, r0 + R).
template <int R>
void score_block_rows(Scratch& s, int64_t r0, int64_t n, int64_t d, int64_t dp) {
  for (int64_t k = 0; k < n; k += Vec::size() / R) {
    s.prefetch.step();
    score_rows<R>(s.q.data() + r0 * dp, s.keys.data() + k, d, dp,
                  s.scores.data() + r0 * kScoreStride + k);
  }
}

// Output columns in groups of up to 16 / R vectors (at most 4: registers for R x C accumulators
// and C values).
template <int R>
void pv_block_rows(Scratch& s, int64_t r0, int64_t n, int64_t d, int64_t dp) {
  constexpr int kMaxC = std::min(4, Vec::size() / R);
  const float* probs = s.scores.data() + r0 * kScoreStride;
  float* acc = s.acc.data() + r0 * dp;
  for (int64_t col = 0; col < dp;) {
    const int64_t vecs = std::min<int64_t>(kMaxC, (dp - col) / Vec::size());
    const int64_t end = col + vecs * Vec::size();
    const int64_t last = std::min(d, end) - (end - Vec::size());  // columns of the last vector
    auto run = [&]<int C>() {
      if (last < Vec::size()) {
        pv_rows<R, C, true>(probs, s.corr.data() + r0, s.values.data(), n, col, last, acc, dp);
      } else {
        pv_rows<R, C, false>(probs, s.corr.data() + r0, s.values.data(), n, col, last, acc, dp);
      }
    };
    switch (vecs) {
      case 1: run.template operator()<1>(); break;
      case 2: if constexpr (kMaxC >= 2) run.template operator()<2>(); break;
      case 3: if constexpr (kMaxC >= 3) run.template operator()<3>(); break;
      default: if constexpr (kMaxC >= 4) run.template operator()<4>(); break;
    }
    col = end;
  }
}

// Calls f.template operator()<R>(r0) over rows [0, rows) in blocks of 4, 2 and 1.
template <typename F>
void for_row_blocks(int64_t rows, F&& f) {
  int64_t r0 = 0;
  for (; r0 + 4 <= rows; r0 += 4) f.template operator()<4>(r0);
  if (r0 + 2 <= rows) {
    f.template operator()<2>(r0);
    r0 += 2;
  }
  if (r0 < rows) f.template operator()<1>(r0);
}

// The cache lines of KV heads [kv_head, kv_head_end) at positions [first, last), a block's run of
// slots at a time (lines shared with heads outside the item are few and harmless).
template <typename T>
void tile_lines(const PagedAttentionArgs& a, const int32_t* block_table, int64_t kv_head,
                int64_t kv_head_end, int64_t first, int64_t last, LinePrefetcher& prefetch) {
  const int64_t slot = a.num_kv_heads * a.head_size;
  prefetch.clear();
  for_block_runs(a, block_table, first, last, [&](int64_t, int64_t offset, int64_t count) {
    const int64_t begin = offset + kv_head * a.head_size;
    const int64_t elements = (count - 1) * slot + (kv_head_end - kv_head) * a.head_size;
    for (const void* cache : {a.key_cache, a.value_cache}) {
      prefetch.add(reinterpret_cast<const char*>(static_cast<const T*>(cache) + begin),
                   elements * static_cast<int64_t>(sizeof(T)));
    }
  });
}

// Attends an item of few rows per KV head (fewer than kTiledMinRows), for one or several KV
// heads of a sequence: see above. Tiles of keys are the outer loop and heads the inner one, so
// a tile's memory is read once, in address order, for all the item's heads.
template <typename T>
void attend_rows(const PagedAttentionArgs& a, const Item& it, Scratch& s) {
  const int64_t d = a.head_size, dp = round_up(d, Vec::size());
  const int64_t group = a.num_heads / a.num_kv_heads;
  const SeqView seq(a, it.seq);
  const int64_t token0 = seq.token0;
  const int32_t* block_table = seq.block_table;
  const int64_t head_rows = (it.q_end - it.q_begin) * group;  // rows per KV head
  const int64_t num_kv = it.kv_head_end - it.kv_head;
  const int64_t rows = head_rows * num_kv;
  const T* query = static_cast<const T*>(a.query);

  // Row r is KV head it.kv_head + r / head_rows; within it, query q_begin + (r % head_rows) /
  // group of query head kv_head * group + r % group.
  auto row_head = [&](int64_t r) { return (it.kv_head + r / head_rows) * group + r % group; };
  auto row_query = [&](int64_t r) { return it.q_begin + (r % head_rows) / group; };
  auto row_hi = [&](int64_t r) { return seq.hi(row_query(r)); };
  auto row_lo = [&](int64_t r) { return seq.lo(row_query(r)); };
  for (int64_t r = 0; r < rows; ++r) {
    float* q = s.q.data() + r * dp;
    convert_to_float(query + (token0 + row_query(r)) * a.query_stride + row_head(r) * d, q, d);
    std::fill(q + d, q + dp, 0.0f);
    std::fill_n(s.acc.data() + r * dp, dp, 0.0f);
    s.max[r] = kNegInf;
    s.sum[r] = 0.0f;
  }

  // fp32 rows of an item of all KV heads are read where they are (d floats each, in address
  // order, the next tile hinted into the cache meanwhile). Otherwise a tile is copied to rows of
  // dp floats: converted from bf16/fp16, or, for some heads only, as a copy whose reads are
  // demand loads (hints for a few lines out of every slot only stall).
  const bool in_place = std::is_same_v<T, float> && num_kv == a.num_kv_heads;
  const int64_t row_len = in_place ? d : dp;
  const Vec scale(a.scale), cap(a.logit_softcap), inv_cap(1.0f / a.logit_softcap);
  const Vec neg_inf(kNegInf);
  const int64_t first_key = row_lo(0);
  const int64_t last_key = row_hi(head_rows - 1) + 1;
  for (int64_t k0 = first_key; k0 < last_key; k0 += kKeyTile) {
    const int64_t k1 = std::min(k0 + kKeyTile, last_key), n = k1 - k0;
    if (in_place) {
      // The next tile's lines are hinted during this tile's score passes (about one per 4 rows x
      // 4 keys).
      tile_lines<T>(a, block_table, it.kv_head, it.kv_head_end, k1,
                    std::min(k1 + kKeyTile, last_key), s.prefetch);
      s.prefetch.start(num_kv * ((head_rows + 3) / 4) * ((n + 3) / 4));
      const int64_t slot = a.num_kv_heads * d;
      for_block_runs(a, block_table, k0, k1, [&](int64_t j, int64_t offset, int64_t count) {
        for (int64_t c = 0; c < count; ++c) {
          s.slots[j - k0 + c] = offset + c * slot + it.kv_head * d;
        }
      });
    } else {
      s.prefetch.clear();
      gather_tile<T>(a, block_table, it.kv_head, it.kv_head_end, k0, k1, dp, s);
    }
    for (int64_t h = 0; h < num_kv; ++h) {
      const int64_t base = h * head_rows;
      if constexpr (std::is_same_v<T, float>) {
        if (in_place) {
          const float* keys = static_cast<const float*>(a.key_cache) + h * d;
          const float* values = static_cast<const float*>(a.value_cache) + h * d;
          for (int64_t t = 0; t < n; ++t) {
            s.keys[t] = keys + s.slots[t];
            s.values[t] = values + s.slots[t];
          }
        }
      }
      if (!in_place) {
        for (int64_t t = 0; t < n; ++t) {
          s.keys[t] = s.key_rows.data() + (h * kKeyTile + t) * dp;
          s.values[t] = s.value_rows.data() + (h * kKeyTile + t) * dp;
        }
      }
      // Passes past n score copies of the last key into the rows' padding.
      std::fill(s.keys.begin() + n, s.keys.end(), s.keys[n - 1]);
      for_row_blocks(head_rows,
                     [&]<int R>(int64_t r0) { score_block_rows<R>(s, base + r0, n, row_len, dp); });
      for (int64_t r = base; r < base + head_rows; ++r) {
        // Keys outside this row's range (and tile columns past the context) take no weight.
        const int64_t lo = std::max(row_lo(r), k0) - k0, hi = std::min(row_hi(r) + 1, k1) - k0;
        const Vec lo_v(static_cast<float>(lo)), hi_v(static_cast<float>(hi));
        float* scores = s.scores.data() + r * kScoreStride;
        Vec tile_max = neg_inf;
        for (int64_t j = 0; j < kKeyTile; j += Vec::size()) {
          Vec x = Vec::loadu(scores + j) * scale;
          if (a.logit_softcap > 0.0f) x = cap * (x * inv_cap).tanh();
          const Vec idx = Vec::arange(static_cast<float>(j), 1.0f);
          x = Vec::blendv(x, neg_inf, (idx < lo_v) | (idx >= hi_v));
          x.store(scores + j);
          tile_max = at::vec::maximum(tile_max, x);
        }
        const float new_max = std::max(
            s.max[r], at::vec::vec_reduce_all<float>(
                          [](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, tile_max));
        // A row with no key yet keeps max -inf; shifting by 0 then gives it probabilities 0.
        const float shift_value = new_max == kNegInf ? 0.0f : new_max;
        const Vec shift(shift_value);
        Vec sum(0.0f);
        for (int64_t j = 0; j < kKeyTile; j += Vec::size()) {
          const Vec p = (Vec::loadu(scores + j) - shift).exp();
          p.store(scores + j);
          sum = sum + p;
        }
        s.corr[r] = std::exp(s.max[r] - shift_value);  // 0 while the row had no key
        s.sum[r] = s.sum[r] * s.corr[r] +
                   at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, sum);
        s.max[r] = new_max;
      }
      for_row_blocks(head_rows,
                     [&]<int R>(int64_t r0) { pv_block_rows<R>(s, base + r0, n, row_len, dp); });
    }
    s.prefetch.finish();
  }

  T* out = static_cast<T*>(a.out);
  for (int64_t r = 0; r < rows; ++r) {
    float* acc = s.acc.data() + r * dp;
    const float inv = s.sum[r] > 0.0f ? 1.0f / s.sum[r] : 0.0f;
    for (int64_t i = 0; i < d; ++i) acc[i] *= inv;
    convert_from_float(acc, out + (token0 + row_query(r)) * a.out_stride + row_head(r) * d, d);
  }
}

// ------------------------------------------------------------------------------- scheduling

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
      Scratch scratch;
      scratch.reserve(max_rows, a.head_size, a.num_kv_heads);
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

KVSERVE_REGISTER_CPU_KERNEL(paged_attention_stub, &paged_attention_impl);

}  // namespace CPU_CAPABILITY
}  // namespace kvserve::cpu
