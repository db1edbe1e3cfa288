// Paged attention, tiled path (prefill): items of at least kTiledMinRows rows, one KV head.
// Flash-attention style tiles. The item's queries are transposed once to q_t [head_dim, rows], so
// the scores of a key tile, S^T [keys, rows], come from a register-blocked micro-kernel that
// broadcasts key elements against vectors of rows, and the online softmax runs a vector of rows
// at a time (no horizontal sums); O [rows, head_dim] += P V with a second micro-kernel.
// Compiled once per CPU capability.
#include <algorithm>
#include <cstdint>

#include "kernels/attention/paged_attention_cpu_kernel.h"

namespace kvserve::cpu {
inline namespace CPU_CAPABILITY {
namespace paged_attention {
namespace {

constexpr int kScoreKeys = 4;          // score micro-kernel: keys x vectors of rows in registers
constexpr int kPvRows = 4;             // P V micro-kernel: rows x vectors of head_dim
constexpr int kVecsPerBlock = 2;

// keys[t], values[t]: fp32 copies (dequantized from an int8 / fp8 cache) of the rows of context
// positions [first, last) in key_rows [kKeyTile, head_dim] / value_rows [kKeyTile, value_stride]
// (columns past value_head_dim are never output, so what lies there does not matter); a value
// inside its key (MLA latents) is read from the key's copy. Copied even when the cache is fp32:
// in place, the rows of a block sit num_kv_heads * head_dim apart (4 KiB for 8 heads of 128
// floats), so a tile's rows would fight over a few L1 sets.
template <typename T>
void load_rows(const PagedAttentionArgs& a, const int32_t* block_table, int64_t kv_head,
               int64_t first, int64_t last, int64_t value_stride, Scratch& s) {
  const int64_t d = a.head_dim, dv = a.value_head_dim;
  for (int64_t j = first; j < last; ++j) {
    const int64_t t = j - first;
    load_key<T>(a, key_offset(a, block_table, j, kv_head), s.key_rows.data() + t * d, d);
    s.keys[t] = s.key_rows.data() + t * d;
    if (a.value_in_key) {
      s.values[t] = s.keys[t];
    } else {
      load_value<T>(a, value_offset(a, block_table, j, kv_head),
                    s.value_rows.data() + t * value_stride, dv);
      s.values[t] = s.value_rows.data() + t * value_stride;
    }
  }
}

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

// acc [rows, dp] += probs^T [rows, n] values [n, dp] (probs' rows mp apart, mp a multiple of
// kPvRows); rows past `rows` up to the next multiple of kPvRows are computed too (padding, never
// read), the rest of mp not at all.
void pv_tile(const float* probs, int64_t mp, int64_t rows, const float* const* values, int64_t n,
             float* acc, int64_t dp) {
  for (int64_t r = 0; r < round_up(rows, kPvRows); r += kPvRows) {
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

}  // namespace

template <typename T>
void attend_tiled(const PagedAttentionArgs& a, const Item& it, Scratch& s) {
  const int64_t d = a.head_dim, dv = a.value_head_dim, dvp = round_up(dv, Vec::size());
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
  std::fill_n(s.acc.data(), mp * dvp, 0.0f);

  const int64_t first_key = row_lo(0), last_key = row_hi(rows - 1) + 1;
  const int64_t all_from = row_lo(rows - 1), all_to = row_hi(0);  // keys every row sees
  for (int64_t k0 = first_key; k0 < last_key; k0 += kKeyTile) {
    const int64_t n = std::min(k0 + kKeyTile, last_key) - k0;
    load_rows<T>(a, block_table, it.kv_head, k0, k0 + n, dvp, s);
    score_tile(s.keys.data(), n, s.q.data(), mp, d, s.scores.data());
    softmax_tile(a, k0, n, mp, k0 < all_from || k0 + n - 1 > all_to, s);
    for (int64_t r = 0; r < rows; ++r) {
      const float corr = s.corr[r];
      if (corr == 1.0f) continue;
      float* acc = s.acc.data() + r * dvp;
      for (int64_t i = 0; i < dvp; i += Vec::size()) {
        (Vec::loadu(acc + i) * Vec(corr)).store(acc + i);
      }
    }
    pv_tile(s.scores.data(), mp, rows, s.values.data(), n, s.acc.data(), dvp);
  }

  T* out = static_cast<T*>(a.out);
  for (int64_t r = 0; r < rows; ++r) {
    float* acc = s.acc.data() + r * dvp;
    const int64_t head = it.kv_head * group + r % group;
    const float inv = softmax_normalizer(s.max[r], s.sum[r], a.sinks, head);
    for (int64_t i = 0; i < dv; ++i) acc[i] *= inv;
    convert_from_float(acc, out + (token0 + it.q_begin + r / group) * a.out_stride + head * dv,
                       dv);
  }
}

template void attend_tiled<float>(const PagedAttentionArgs&, const Item&, Scratch&);
template void attend_tiled<c10::BFloat16>(const PagedAttentionArgs&, const Item&, Scratch&);
template void attend_tiled<c10::Half>(const PagedAttentionArgs&, const Item&, Scratch&);

}  // namespace paged_attention
}  // namespace CPU_CAPABILITY
}  // namespace kvserve::cpu
