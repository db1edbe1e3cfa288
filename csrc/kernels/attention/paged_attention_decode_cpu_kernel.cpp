// Paged attention, dot-product path (decode, short chunks): items of fewer than kTiledMinRows
// rows per KV head, for one or several KV heads of a sequence. Register-blocked dot products of a
// few rows against a few keys, over a tile copied from the cache in address order (or, for fp32
// items of all KV heads, read in place while the next tile is hinted into the cache).
// Compiled once per CPU capability.
//
// Rows go in blocks of R (4, 2 or 1) that share every key and value load, and Vec::size()
// vector accumulators per pass (R rows x Vec::size() / R keys or columns; half the registers of
// AVX2 and AVX512 alike). Scores accumulate vertically over head_dim and are reduced to one
// vector of Vec::size() scores at the end of the pass; P V keeps a block of each row's output in
// registers across the tile, so the accumulator in memory is touched once per tile, not per key.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/attention/paged_attention_cpu_kernel.h"

namespace kvserve::cpu {
inline namespace CPU_CAPABILITY {
namespace paged_attention {
namespace {

constexpr int64_t kScoreStride = kKeyTile + Vec::size();  // a row's scores, with pass padding

// Calls f(position, count) for the runs of positions [first, last) that share a block: the next
// count - 1 slots follow position's at a stride of one slot, in the key and the value cache.
template <typename F>
void for_block_runs(const PagedAttentionArgs& a, int64_t first, int64_t last, F&& f) {
  for (int64_t j = first; j < last;) {
    const int64_t count = std::min(last - j, a.block_size - j % a.block_size);
    f(j, count);
    j += count;
  }
}

// Copies the rows of KV heads [kv_head, kv_head_end) at positions [first, last) to key_rows /
// value_rows as fp32 [head, kKeyTile, dp] / [head, kKeyTile, dvp] (columns past head_dim and
// value_head_dim set to 0: the scratch is reused, and garbage there, NaN say, times the query's
// zero padding would not be 0; a value inside its key is read from the key's copy). The heads of a position
// are adjacent in the cache and the positions of a block too, so this reads whole runs of memory
// in address order, which the hardware prefetchers follow; reading one head's rows in place
// instead touches a few lines of every slot and runs at a fraction of the memory bandwidth.
template <typename T>
void gather_tile(const PagedAttentionArgs& a, const int32_t* block_table, int64_t kv_head,
                 int64_t kv_head_end, int64_t first, int64_t last, int64_t dp, int64_t dvp,
                 Scratch& s) {
  const int64_t d = a.head_dim, dv = a.value_head_dim;
  const int64_t key_slot = a.num_kv_heads * d, value_slot = a.num_kv_heads * a.value_row;
  for_block_runs(a, first, last, [&](int64_t j0, int64_t count) {
    const int64_t key0 = key_offset(a, block_table, j0, kv_head);
    const int64_t value0 = value_offset(a, block_table, j0, kv_head);
    for (int64_t c = 0; c < count; ++c) {
      const int64_t j = j0 + c;
      for (int64_t h = 0; h < kv_head_end - kv_head; ++h) {
        float* key_row = s.key_rows.data() + (h * kKeyTile + j - first) * dp;
        load_key<T>(a, key0 + c * key_slot + h * d, key_row, d);
        std::fill(key_row + d, key_row + dp, 0.0f);
        if (!a.value_in_key) {
          float* value_row = s.value_rows.data() + (h * kKeyTile + j - first) * dvp;
          load_value<T>(a, value0 + c * value_slot + h * a.value_row, value_row, dv);
          std::fill(value_row + dv, value_row + dvp, 0.0f);
        }
      }
    }
  });
}

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
  const int64_t heads = kv_head_end - kv_head;
  prefetch.clear();
  auto add = [&](const void* cache, int64_t begin, int64_t row, int64_t count) {
    const int64_t elements = (count - 1) * a.num_kv_heads * row + heads * row;
    prefetch.add(reinterpret_cast<const char*>(static_cast<const T*>(cache) + begin),
                 elements * static_cast<int64_t>(sizeof(T)));
  };
  for_block_runs(a, first, last, [&](int64_t j, int64_t count) {
    add(a.key_cache, key_offset(a, block_table, j, kv_head), a.head_dim, count);
    if (!a.value_in_key) {
      add(a.value_cache, value_offset(a, block_table, j, kv_head), a.value_row, count);
    }
  });
}

}  // namespace

// Attends an item of few rows per KV head (fewer than kTiledMinRows), for one or several KV
// heads of a sequence: see above. Tiles of keys are the outer loop and heads the inner one, so
// a tile's memory is read once, in address order, for all the item's heads.
template <typename T>
void attend_rows(const PagedAttentionArgs& a, const Item& it, Scratch& s) {
  const int64_t d = a.head_dim, dp = round_up(d, Vec::size());
  const int64_t dv = a.value_head_dim, dvp = round_up(dv, Vec::size());
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
    std::fill_n(s.acc.data() + r * dvp, dvp, 0.0f);
    s.max[r] = kNegInf;
    s.sum[r] = 0.0f;
  }

  // fp32 rows of an item of all KV heads are read where they are (d floats each, in address
  // order, the next tile hinted into the cache meanwhile). Otherwise a tile is copied to rows of
  // dp floats: converted from bf16/fp16, dequantized from int8/fp8, or, for some heads only, as
  // a copy whose reads are demand loads (hints for a few lines out of every slot only stall).
  const bool in_place = std::is_same_v<T, float> && a.cache_format == KVCacheFormat::kPlain &&
                        num_kv == a.num_kv_heads;
  const int64_t row_len = in_place ? d : dp, value_len = in_place ? dv : dvp;
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
      const int64_t key_slot = a.num_kv_heads * d, value_slot = a.num_kv_heads * a.value_row;
      for_block_runs(a, k0, k1, [&](int64_t j, int64_t count) {
        const int64_t key0 = key_offset(a, block_table, j, it.kv_head);
        const int64_t value0 = value_offset(a, block_table, j, it.kv_head);
        for (int64_t c = 0; c < count; ++c) {
          s.slots[j - k0 + c] = key0 + c * key_slot;
          s.value_slots[j - k0 + c] = value0 + c * value_slot;
        }
      });
    } else {
      s.prefetch.clear();
      gather_tile<T>(a, block_table, it.kv_head, it.kv_head_end, k0, k1, dp, dvp, s);
    }
    for (int64_t h = 0; h < num_kv; ++h) {
      const int64_t base = h * head_rows;
      if constexpr (std::is_same_v<T, float>) {
        if (in_place) {
          const float* keys = static_cast<const float*>(a.key_cache) + h * d;
          const float* values = static_cast<const float*>(a.value_cache) + h * a.value_row;
          for (int64_t t = 0; t < n; ++t) {
            s.keys[t] = keys + s.slots[t];
            s.values[t] = values + s.value_slots[t];
          }
        }
      }
      if (!in_place) {
        for (int64_t t = 0; t < n; ++t) {
          s.keys[t] = s.key_rows.data() + (h * kKeyTile + t) * dp;
          s.values[t] = a.value_in_key ? s.keys[t] : s.value_rows.data() + (h * kKeyTile + t) * dvp;
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
      for_row_blocks(head_rows, [&]<int R>(int64_t r0) {
        pv_block_rows<R>(s, base + r0, n, value_len, dvp);
      });
    }
    s.prefetch.finish();
  }

  T* out = static_cast<T*>(a.out);
  for (int64_t r = 0; r < rows; ++r) {
    float* acc = s.acc.data() + r * dvp;
    const float inv = softmax_normalizer(s.max[r], s.sum[r], a.sinks, row_head(r));
    for (int64_t i = 0; i < dv; ++i) acc[i] *= inv;
    convert_from_float(acc, out + (token0 + row_query(r)) * a.out_stride + row_head(r) * dv, dv);
  }
}

template void attend_rows<float>(const PagedAttentionArgs&, const Item&, Scratch&);
template void attend_rows<c10::BFloat16>(const PagedAttentionArgs&, const Item&, Scratch&);
template void attend_rows<c10::Half>(const PagedAttentionArgs&, const Item&, Scratch&);

}  // namespace paged_attention
}  // namespace CPU_CAPABILITY
}  // namespace kvserve::cpu
