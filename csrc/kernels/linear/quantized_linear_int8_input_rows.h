// The integer-dot row kernels (quantized_linear_int8_input_cpu_kernel.cpp, which includes this
// once per CPU capability): a row of int8 groups of 16 (sixteens_row), int4 rows a step of
// Pairs or Quads at a time (int4_row, int4_rows) and int8 rows one or two blocks of 32 a load
// (int8_rows), each for a block of tokens.
#pragma once

#include "kernels/linear/quantized_linear_int8_input_lanes.h"

namespace kvserve::cpu {
inline namespace CPU_CAPABILITY {
namespace {

#if KVSERVE_INT8_DOT_SIMD
// sum[t] plus one int8 row in groups of 16 (GGUF's Q6_K; a group is also an input block) times
// TB tokens, L::kBlocks groups a load (Pairs: 2, Quads: 4) from group b on while whole loads
// last; returns the first group left. Each group's int32 sums (four lanes) take its input scale
// times its weight scale in one FMA, into two accumulators a token in turn (one would wait on
// its FMA every load).
template <typename L, int64_t TB, bool kTwoLevel>
int64_t sixteens_row(const int8_t* const* xq, const float* const* xs, const uint8_t* row,
                     const RowScales& scales, int64_t b, int64_t groups, float* sum) {
  using Float = typename L::Float;
  using Acc = Sums<L, 1, TB>;
  constexpr int64_t kStep = L::kBlocks;
  // acc plus the load of groups from b.
  const auto step = [&](Acc acc, int64_t b) {
    if (b % 4 == 0) prefetch_ahead(row + b * 16);
    const typename L::Int w = L::load(row + b * 16);
    const typename L::Int magnitude = L::magnitude(w);
    const Float weight = scales.blocks<L, kTwoLevel>(b);
    for (int64_t t = 0; t < TB; ++t) {
      const Float dot = L::dot(magnitude, L::signed_input(L::load(xq[t] + b * 16), w));
      acc.v[0][t] = L::fmadd(dot, L::mul(L::block_scales(xs[t] + b), weight), acc.v[0][t]);
    }
    return acc;
  };
  if (b + kStep > groups) return b;
  Acc acc0 = Acc::zero(), acc1 = Acc::zero();
  for (; b + 2 * kStep <= groups; b += 2 * kStep) {
    acc0 = step(acc0, b);
    acc1 = step(acc1, b + kStep);
  }
  if (b + kStep <= groups) acc0 = step(acc0, b), b += kStep;
  for (int64_t t = 0; t < TB; ++t) sum[t] += L::sum(L::add(acc0.v[0][t], acc1.v[0][t]));
  return b;
}

// The weight scales of the pair of blocks (b, b + 1) in the lanes of their sums.
__m256 pair_weight_scales(const float* scales, const int32_t* group, int64_t b,
                          int64_t per_group) {
  if (per_group == 1) return Pairs::block_scales(scales + b);
  return _mm256_set_m128(_mm_set1_ps(scales[group[b + 1]]), _mm_set1_ps(scales[group[b]]));
}

// The sums of one int4 row (groups a multiple of 32) times TB tokens where int4_rows does not
// take it: an odd number of blocks of 32, or groups of an odd number of blocks (96, 160, ...). A
// pair of blocks comes from one 32-byte load, the tokens' q interleaved to match (interleave),
// and its sums take the pair's input scales times its blocks' weight scales in one FMA; an odd
// last block in its own order. Two accumulators per token, so that FMA latency does not bound
// the loop.
template <int64_t TB>
void int4_row(const RoundedInput& x, const int8_t* const* xq, const float* const* xs,
              const float* const* xp, const uint8_t* row, const float* scales, float* sum) {
  const int64_t blocks = x.blocks, per_group = blocks / x.groups;
  const int32_t* group = x.block_group.data();
  __m256 acc0[TB], acc1[TB];
  for (int64_t t = 0; t < TB; ++t) acc0[t] = acc1[t] = _mm256_setzero_ps();
  // Adds the pair (b, b + 1) to acc, its input scales times its blocks' weight scales.
  const auto pair = [&](__m256* acc, int64_t b) {
    const __m256 weight = pair_weight_scales(scales, group, b, per_group);
    __m256i lo, hi;
    Pairs::nibbles(row + b * 16, lo, hi);
    for (int64_t t = 0; t < TB; ++t) {
      const int8_t* in = xq[t] + b * kBlock;
      acc[t] = _mm256_fmadd_ps(Pairs::dot(lo, hi, Pairs::load(in), Pairs::load(in + kBlock)),
                               _mm256_mul_ps(_mm256_loadu_ps(xp[t] + b * 4), weight), acc[t]);
    }
  };
  int64_t b = 0;
  for (; b + 4 <= blocks; b += 4) {
    prefetch_ahead(row + b * 16);
    pair(acc0, b);
    pair(acc1, b + 2);
  }
  if (b + 2 <= blocks) pair(acc0, b), b += 2;
  for (int64_t t = 0; t < TB; ++t) sum[t] = sum_lanes(_mm256_add_ps(acc0[t], acc1[t]));
  if (b < blocks) {  // an odd last block, in its own order
    const WeightBlock last = load_block<F::kInt4>(row, b * kBlock);
    for (int64_t t = 0; t < TB; ++t) {
      sum[t] += xs[t][b] * scales[group[b]] *
                static_cast<float>(sum_lanes_int(dot_block<F::kInt4>(last, xq[t] + b * kBlock)));
    }
  }
}

// Rows int4_rows and int8_rows take at once for TB tokens: one, streamed alone, reads fastest for
// a single token; from two tokens on, int4 takes kMaxRowsAtOnce rows, which cut the loads of
// inputs per weight byte (at four tokens: 1.3-2.8x one row at a time on a Zen 4 with AVX-512).
// int8 stays at one: in-process A/B on a Zen 4, a [5632, 2048] projection at 4 and 16 tokens,
// one row at a time was 1.1-1.45x two (two blocks a load) and 1.1-1.2x (one block a load).
template <QuantFormat f, int64_t TB>
constexpr int64_t kRowsAtOnce = TB == 1 || f == QuantFormat::kInt8 ? 1 : kMaxRowsAtOnce;

// The sums of R int4 rows times TB tokens, L::kBlocks blocks (one load a row) at a time: groups
// of 32, or of an even number of blocks (Pairs) or a multiple of four (Quads). Each token's
// inputs and input scales are loaded once a step for all R rows: those loads are three times
// the weight's bytes, and with several tokens they, not the weight's, bound a row taken alone.
// Every step's sums take its input scales times the weight scale of its blocks (groups of 32)
// or of its group in one FMA, into one accumulator per row and token, or two taken in turn
// where there are fewer than four chains. One token on AVX-512 takes the product of the two
// scales on 128 bits, then spreads it (L::kNarrowScales; xs: its block scales, xp: spread).
template <typename L, int64_t TB, int64_t R, bool kTwoLevel>
void int4_rows(const RoundedInput& x, const int8_t* const* xq, const float* const* xs,
               const float* const* xp, const uint8_t* const* rows, const RowScales* scales,
               float (*sum)[TB]) {
  using Int = typename L::Int;
  using Float = typename L::Float;
  using Acc = Sums<L, R, TB>;
  constexpr int64_t kSets = R * TB < 4 ? 2 : 1;
  constexpr int64_t kStep = L::kBlocks;
  const int64_t blocks = x.blocks, per_group = blocks / x.groups;
  const int32_t* group = x.block_group.data();  // (a load, not a division, each step)
  // acc plus the step of blocks from b of the R rows.
  const auto step = [&](Acc acc, int64_t b) {
    if (b % 4 == 0) {  // a cache line a row for every 4 blocks; the R rows are contiguous
      for (int64_t r = 0; r < R; ++r) prefetch_ahead(rows[0] + (b / 4 * R + r) * 64);
    }
    // The rows' weights unpacked once, then each token's inputs loaded once for all of them
    // (so that registers hold R rows' weights, not TB tokens' inputs: AVX2 has 16).
    Int lo[R], hi[R];
    for (int64_t r = 0; r < R; ++r) L::nibbles(rows[r] + b * 16, lo[r], hi[r]);
    if constexpr (TB == 1 && L::kNarrowScales) {
      const __m128 x_scale = L::narrow(xs[0] + b);
      const Int x_lo = L::load(xq[0] + b * kBlock);
      const Int x_hi = L::load(xq[0] + b * kBlock + kStep * 16);
      for (int64_t r = 0; r < R; ++r) {
        __m128 weight;
        if constexpr (kTwoLevel) {
          weight = scales[r].narrow<L, true>(b);
        } else {
          weight = per_group == 1 ? scales[r].narrow<L, false>(b)
                                  : _mm_set1_ps(scales[r].scales[group[b]]);
        }
        acc.v[r][0] = L::fmadd(L::dot(lo[r], hi[r], x_lo, x_hi),
                               L::spread(_mm_mul_ps(x_scale, weight)), acc.v[r][0]);
      }
      return acc;
    }
    Float weight[R];
    for (int64_t r = 0; r < R; ++r) {
      if constexpr (kTwoLevel) {
        weight[r] = scales[r].blocks<L, true>(b);
      } else {
        weight[r] = per_group == 1 ? scales[r].blocks<L, false>(b)
                                   : L::splat(scales[r].scales[group[b]]);
      }
    }
    for (int64_t t = 0; t < TB; ++t) {
      const Int x_lo = L::load(xq[t] + b * kBlock);
      const Int x_hi = L::load(xq[t] + b * kBlock + kStep * 16);
      const Float x_scale = L::floats(xp[t] + b * 4);
      for (int64_t r = 0; r < R; ++r) {
        acc.v[r][t] = L::fmadd(L::dot(lo[r], hi[r], x_lo, x_hi), L::mul(x_scale, weight[r]),
                               acc.v[r][t]);
      }
    }
    return acc;
  };
  Acc acc0 = Acc::zero(), acc1 = Acc::zero();
  int64_t b = 0;
  for (; b + kSets * kStep <= blocks; b += kSets * kStep) {
    acc0 = step(acc0, b);
    if constexpr (kSets == 2) acc1 = step(acc1, b + kStep);
  }
  if (b < blocks) acc0 = step(acc0, b);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t t = 0; t < TB; ++t) {
      sum[r][t] = L::sum(kSets == 2 ? L::add(acc0.v[r][t], acc1.v[r][t]) : acc0.v[r][t]);
    }
  }
}

// A row's weight scales of the blocks at b for the int32 sums of L's width that int8_rows takes a
// load of weights into (Q8_0's groups of one block): one block (Pairs' 256 bits) on all eight
// lanes, or two (Quads' 512 bits) on eight lanes each.
template <typename L>
typename L::Float int8_block_scales(const float* p) {
#if KVSERVE_INT4_QUADS
  if constexpr (std::is_same_v<L, Quads>) {
    return _mm512_insertf32x8(_mm512_set1_ps(p[0]), _mm256_set1_ps(p[1]), 1);
  } else
#endif
  {
    return _mm256_broadcast_ss(p);
  }
}

// The sums of R int8 rows (groups a multiple of 32) times TB tokens, a load of L's width at a
// time (Pairs: one block of 32; Quads: two, where the blocks come in pairs that share a group or
// are groups of their own): each token's inputs and their scales are loaded once for all R rows,
// and each row's weights once for all TB tokens (its sign moved onto the inputs). Each load's sums
// take their blocks' input scales; groups of one block (llama.cpp's Q8_0) the weight's scales
// with them, larger groups theirs once per group (once per row for per-channel weights): a group's
// sum waits on the FMAs before it, which for one block a group would bound the loop. One
// accumulator per row and token, or two taken in turn where there are fewer than four chains.
// AVX-512's two blocks a load take half the instructions per weight of one (a [5632, 2048]
// projection at 4 and 16 tokens 1.2-1.5x faster).
// xs: each token's block scales, one a block (Pairs) or spread eight lanes a block (Quads:
// x.lane_scale).
template <typename L, int64_t TB, int64_t R>
void int8_rows(const RoundedInput& x, const int8_t* const* xq, const float* const* xs,
               const uint8_t* const* rows, const RowScales* scales, float (*sum)[TB]) {
  using Int = typename L::Int;
  using Float = typename L::Float;
  constexpr int64_t kSets = R * TB < 4 ? 2 : 1;
  constexpr int64_t kSpan = static_cast<int64_t>(sizeof(Int)) / kBlock;  // blocks a load
  using Acc = Sums<L, R, TB>;
  // acc plus the load at block b of the R rows; with_weight: its input scales times its weight
  // scales.
  const auto block = [&](auto with_weight, Acc acc, int64_t b) {
    if (b % 2 == 0) {  // a cache line a row for every 2 blocks; the R rows are contiguous
      for (int64_t r = 0; r < R; ++r) prefetch_ahead(rows[0] + (b / 2 * R + r) * 64);
    }
    // The rows' weights loaded once, then each token's inputs once for all of them.
    Int w[R], magnitude[R];
    Float weight[R];
    for (int64_t r = 0; r < R; ++r) {
      w[r] = L::load(rows[r] + b * kBlock);
      magnitude[r] = L::magnitude(w[r]);
      if constexpr (decltype(with_weight)::value) {
        weight[r] = int8_block_scales<L>(scales[r].scales + b);
      }
    }
    for (int64_t t = 0; t < TB; ++t) {
      const Int in = L::load(xq[t] + b * kBlock);
      Float in_scale;
      if constexpr (kSpan == 1) {
        in_scale = int8_block_scales<L>(xs[t] + b);
      } else {
        in_scale = L::floats(xs[t] + b * 8);
      }
      for (int64_t r = 0; r < R; ++r) {
        const Float dot = L::dot(magnitude[r], L::signed_input(in, w[r]));
        Float scale = in_scale;
        if constexpr (decltype(with_weight)::value) scale = L::mul(scale, weight[r]);
        acc.v[r][t] = L::fmadd(dot, scale, acc.v[r][t]);
      }
    }
    return acc;
  };
  Acc acc0, acc1, total;
  // Blocks [b, last) into acc0 (and acc1 in turn).
  const auto blocks = [&](auto with_weight, int64_t& b, int64_t last) {
    for (; b + kSets * kSpan <= last; b += kSets * kSpan) {
      acc0 = block(with_weight, acc0, b);
      if constexpr (kSets == 2) acc1 = block(with_weight, acc1, b + kSpan);
    }
    if (b < last) acc0 = block(with_weight, acc0, b), b += kSpan;
  };
  // acc0 (plus acc1) [r][t].
  const auto both = [&](int64_t r, int64_t t) {
    return kSets == 2 ? L::add(acc0.v[r][t], acc1.v[r][t]) : acc0.v[r][t];
  };
  acc0 = acc1 = Acc::zero();
  int64_t b = 0;
  if (x.blocks == x.groups) {  // groups of one block
    blocks(std::true_type{}, b, x.blocks);
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t t = 0; t < TB; ++t) sum[r][t] = L::sum(both(r, t));
    }
    return;
  }
  total = Acc::zero();
  const int64_t per_group = x.blocks / x.groups;
  for (int64_t gi = 0; gi < x.groups; ++gi) {
    blocks(std::false_type{}, b, (gi + 1) * per_group);
    for (int64_t r = 0; r < R; ++r) {
      const Float weight = L::splat(scales[r].scales[gi]);
      for (int64_t t = 0; t < TB; ++t) {
        total.v[r][t] = L::fmadd(both(r, t), weight, total.v[r][t]);
      }
    }
    acc0 = acc1 = Acc::zero();
  }
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t t = 0; t < TB; ++t) sum[r][t] = L::sum(total.v[r][t]);
  }
}
#endif

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace kvserve::cpu
