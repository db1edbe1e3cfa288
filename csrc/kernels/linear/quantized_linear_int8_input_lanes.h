// The integer-dot kernels' building blocks (quantized_linear_int8_input_cpu_kernel.cpp, which
// includes this once per CPU capability): the constants, the rounded input, one block's dot
// product, the lane types a step of int4 / Q6_K weights is loaded into (Pairs, Quads) with their
// accumulators (Sums), and two-level scales widened a step at a time (RowScales).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#define KVSERVE_INT8_DOT_SIMD 1
#else
#define KVSERVE_INT8_DOT_SIMD 0
#endif
// AVX-512: int4 rows four blocks (one 64-byte load) at a time where k is a multiple of 128 and a
// group is one block or a multiple of four (Quads, int4_rows).
#if defined(CPU_CAPABILITY_AVX512)
#define KVSERVE_INT4_QUADS 1
#else
#define KVSERVE_INT4_QUADS 0
#endif

#include "kernels/cpu_kernels.h"
#include "kernels/cpu_vec.h"

namespace kvserve::cpu {
inline namespace CPU_CAPABILITY {
namespace {

constexpr int64_t kBlock = 32;      // inputs per int8 block
constexpr int64_t kTokenBlock = 4;  // tokens per pass over a tile of rows
constexpr int64_t kRowGrain = 16;   // output rows per parallel task at least
constexpr int64_t kRowTile = 16;    // rows taken through every token block before the next ones
// Rows a row kernel takes at once from two tokens on (kRowsAtOnce): two where the CPU has 32
// vector registers (AVX-512); with AVX2's 16, two rows' accumulators and inputs spill (int4 at
// four tokens 0.8-0.9x one row at a time).
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kMaxRowsAtOnce = 2;
#else
constexpr int64_t kMaxRowsAtOnce = 1;
#endif
// Bytes ahead of a row kernel's reads that it asks the cache for (prefetch_ahead). Rows are
// read front to back, one after another, yet on a Zen 4 VM asking for them ahead reads a
// streamed projection 1.1-1.25x faster at one token (int8 and int4, every row kernel) and up to
// 2x at four (2 threads, interleaved calls with and without); 4 and 8 KB measured the same.
// How they are asked for depends on the CPU (prefetch_stream, StreamPrefetch): non-temporally on
// AMD, into L2 elsewhere.
constexpr int64_t kPrefetchAhead = 8192;

using F = QuantFormat;

// The input of m tokens rounded to int8: q [m, k] in the input's order, the scale of each block
// [m, blocks], and (weights with zeros) the rounded input's sum over each group [m, groups].
struct RoundedInput {
  LineVector<int8_t> q;
  std::vector<float> scale, group_sum;
  // int4 weights: each pair of blocks' scales where the pair's sums have them, four lanes each
  // (int4_row), [m, pair_stride].
  LineVector<float> pair_scale;
  // int8 weights on AVX-512: each block's scale on eight lanes (int8_rows, two blocks a load),
  // [m, lane_stride].
  LineVector<float> lane_scale;
  std::vector<int32_t> block_group;  // [blocks]: the group each block belongs to
  int64_t k = 0, blocks = 0, groups = 0, pair_stride = 0, lane_stride = 0;
  // int4 on AVX-512, k a multiple of 128 in groups of 32 or of a multiple of 128: q
  // interleaved by fours of blocks (interleave), the rows taken by int4_rows as Quads.
  bool quads = false;
};


// Bytes of a row before input i (i a multiple of 32 for int4).
template <F f>
int64_t byte_offset(int64_t i) {
  return f == F::kInt4 ? i / 2 : i;
}

// q * x summed over a block's inputs [i, i + len) in exact integers (the block tails of int8
// groups that are not a multiple of 32, and the capability without vector code).
template <F f>
int32_t dot_scalar(const uint8_t* row, const int8_t* x, int64_t i, int64_t len) {
  int32_t sum = 0;
  for (int64_t j = 0; j < len; ++j) {
    int32_t qj;
    if constexpr (f == F::kInt4) {
      const uint8_t byte = row[i / 2 + j % 16];
      qj = j < 16 ? byte & 0x0f : byte >> 4;
    } else {
      qj = static_cast<int8_t>(row[i + j]);
    }
    sum += qj * x[i + j];
  }
  return sum;
}

#if KVSERVE_INT8_DOT_SIMD
// The 32 weights of the block at input i, ready for maddubs against any token's inputs: the
// unsigned operand (int4: one byte per nibble in input order, low nibbles being inputs 0-15 and
// high ones 16-31; int8: |q|) and, for int8, q itself, whose sign moves onto the input.
struct WeightBlock {
  __m256i magnitude, sign;
};

template <F f>
WeightBlock load_block(const uint8_t* row, int64_t i) {
  if constexpr (f == F::kInt4) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i / 2));
    const __m128i low = _mm_set1_epi8(0x0f);
    return {_mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low),
                             _mm_and_si128(bytes, low)),
            _mm256_setzero_si256()};
  } else {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + i));
    return {_mm256_sign_epi8(q, q), q};
  }
}

// acc plus, in each int32 lane, the four products of its unsigned bytes of u and signed bytes of
// s (vpdpbusd; without VNNI, maddubs into int16 pairs, which the callers keep from saturating,
// then madd by ones).
inline __m256i dot_add(__m256i acc, __m256i u, __m256i s) {
#if defined(CPU_CAPABILITY_AVX512) && defined(CPU_CAPABILITY_VNNI)  // AVX512_VNNI, AVX512_AMX
  return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(CPU_CAPABILITY_AVX2_VNNI)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                 _mm256_set1_epi16(1)));
#endif
}

// Eight int32 partial sums of weights * inputs over a block (x: the block's 32 int8 inputs).
template <F f>
__m256i dot_block(const WeightBlock& w, const int8_t* x) {
  __m256i input = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  if constexpr (f == F::kInt8) input = _mm256_sign_epi8(input, w.sign);
  return dot_add(_mm256_setzero_si256(), w.magnitude, input);
}

int32_t sum_lanes_int(__m256i v) {
  const __m128i four = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i two = _mm_add_epi32(four, _mm_unpackhi_epi64(four, four));
  return _mm_cvtsi128_si32(_mm_add_epi32(two, _mm_shuffle_epi32(two, 1)));
}

float sum_lanes(__m256 v) {
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}
#endif

#if KVSERVE_INT8_DOT_SIMD
// Asks for the cache line kPrefetchAhead bytes past p (no fault if past the weight's end).
inline void prefetch_ahead(const uint8_t* p) {
  prefetch_stream(p + kPrefetchAhead);
}
#endif

// sum over groups of factor * (the token's rounded input summed over the group): the zero term
// of two-level offsets (factors = offsets), or, less the zero, of a zero shared by every group
// (factors = scales).
float group_dot(const float* factors, const float* sums, int64_t groups) {
  int64_t gi = 0;
  float part = 0.0f;
#if KVSERVE_INT8_DOT_SIMD
  __m256 acc = _mm256_setzero_ps();
  for (; gi + 8 <= groups; gi += 8) {
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(factors + gi), _mm256_loadu_ps(sums + gi), acc);
  }
  part = sum_lanes(acc);
#endif
  for (; gi < groups; ++gi) part += factors[gi] * sums[gi];
  return part;
}

// sum over groups of zero * scale * (the token's rounded input summed over the group).
float zero_part(const float* zeros, const float* scales, const float* sums, int64_t groups) {
  int64_t gi = 0;
  float part = 0.0f;
#if KVSERVE_INT8_DOT_SIMD
  __m256 acc = _mm256_setzero_ps();
  for (; gi + 8 <= groups; gi += 8) {
    acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(zeros + gi), _mm256_loadu_ps(scales + gi)),
                          _mm256_loadu_ps(sums + gi), acc);
  }
  part = sum_lanes(acc);
#endif
  for (; gi < groups; ++gi) part += zeros[gi] * scales[gi] * sums[gi];
  return part;
}

#if KVSERVE_INT8_DOT_SIMD
// Keeps v in a register: the compiler would otherwise fold its load into each instruction that
// reads it, loading a step of int4 weights twice (for the low and the high nibbles), and loads
// are what bounds int4_rows at one token (from cache, a [5632, 2048] projection 1.08-1.13x
// faster with the weights loaded once).
template <typename V>
inline void in_register(V& v) {
  asm("" : "+v"(v));
}

// int4 blocks as int4_rows takes them: Pairs, two blocks from one 32-byte load (AVX2 and up);
// Quads, four from one 64-byte load (AVX-512). The tokens' inputs are interleaved to match
// (interleave) and their scales spread four lanes a block (x.pair_scale), so that a step's
// integer sums, one int32 lane for each four products, take them in one multiply: lanes 4i to
// 4i + 3 hold block i's sums.
struct Pairs {
  using Int = __m256i;
  using Float = __m256;
  static constexpr int64_t kBlocks = 2;
  static constexpr bool kNarrowScales = false;  // (Quads)
  static Int load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  // A step's weights unpacked: low nibbles (inputs 0-15 of each block), high ones (16-31).
  static void nibbles(const uint8_t* p, Int& lo, Int& hi) {
    Int bytes = load(p);
    in_register(bytes);
    const Int low = _mm256_set1_epi8(0x0f);
    lo = _mm256_and_si256(bytes, low);
    hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
  }
  // The weights times the inputs summed in int32, as floats.
  static Float dot(Int lo, Int hi, Int x_lo, Int x_hi) {
#if defined(CPU_CAPABILITY_VNNI)
    return _mm256_cvtepi32_ps(dot_add(dot_add(_mm256_setzero_si256(), lo, x_lo), hi, x_hi));
#else
    // Both halves' int16 pair sums added before widening: at most 2 * 2 * 15 * 127.
    const Int pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, x_lo),
                                       _mm256_maddubs_epi16(hi, x_hi));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
  }
  // int8 weights w: |w|, the unsigned operand, and the inputs x with w's signs.
  static Int magnitude(Int w) { return _mm256_sign_epi8(w, w); }
  static Int signed_input(Int x, Int w) { return _mm256_sign_epi8(x, w); }
  // Unsigned u times signed s summed four products a lane, as floats (|u| <= 128, |s| <= 127:
  // maddubs's int16 pairs do not saturate).
  static Float dot(Int u, Int s) { return _mm256_cvtepi32_ps(dot_add(_mm256_setzero_si256(), u, s)); }
  static Float floats(const float* p) { return _mm256_loadu_ps(p); }
  static Float splat(float v) { return _mm256_set1_ps(v); }
  // The step's blocks' weight scales (groups of 32: llama.cpp's Q4_0 / Q4_1), each on its lanes.
  static Float block_scales(const float* scales) {
    // (an unaligned 8-byte load: scales is 4-byte aligned)
    const __m128 two =
        _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales)));
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(two),
                                    _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0));
  }
  // Two-level scales: the step's groups' int8 scales times their super-block's factor, each on
  // its lanes.
  static Float sub_scales(const int8_t* ints, float factor) {
    int16_t two;
    std::memcpy(&two, ints, sizeof(two));
    const __m128i spread = _mm_shuffle_epi8(_mm_cvtsi32_si128(two),
                                            _mm_set_epi64x(0, 0x0101010100000000));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(spread)),
                         _mm256_set1_ps(factor));
  }
  static Float add(Float a, Float b) { return _mm256_add_ps(a, b); }
  static Float mul(Float a, Float b) { return _mm256_mul_ps(a, b); }
  static Float fmadd(Float a, Float b, Float c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(Float v) { return sum_lanes(v); }
};

#if KVSERVE_INT4_QUADS
struct Quads {
  using Int = __m512i;
  using Float = __m512;
  static constexpr int64_t kBlocks = 4;
  static Int load(const void* p) { return _mm512_loadu_si512(p); }
  static void nibbles(const uint8_t* p, Int& lo, Int& hi) {
    Int bytes = load(p);
    in_register(bytes);
    const Int low = _mm512_set1_epi8(0x0f);
    lo = _mm512_and_si512(bytes, low);
    hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
  }
  static Float dot(Int lo, Int hi, Int x_lo, Int x_hi) {
#if defined(CPU_CAPABILITY_VNNI)
    return _mm512_cvtepi32_ps(
        _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, x_lo), hi, x_hi));
#else
    const Int pairs = _mm512_add_epi16(_mm512_maddubs_epi16(lo, x_lo),
                                       _mm512_maddubs_epi16(hi, x_hi));
    return _mm512_cvtepi32_ps(_mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
#endif
  }
  // AVX-512 has no sign_epi8: the inputs are negated where w's sign bit is set.
  static Int magnitude(Int w) { return _mm512_abs_epi8(w); }
  static Int signed_input(Int x, Int w) {
    return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
  }
  static Float dot(Int u, Int s) {
#if defined(CPU_CAPABILITY_VNNI)
    return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s));
#else
    return _mm512_cvtepi32_ps(_mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
  }
  static Float floats(const float* p) { return _mm512_loadu_ps(p); }
  static Float splat(float v) { return _mm512_set1_ps(v); }
  // One token's step scales as int4_rows takes them (kNarrowScales): the product of the input's
  // and the weight's on 128 bits, one block a lane (narrow: from fp32, or two-level as
  // sub_scales), then spread on the blocks' lanes, instead of a 64-byte load of the input's
  // spread scales (from cache, a [5632, 2048] projection 1.1x faster at one token). Pairs
  // keeps the spread load: on AVX2 this form ran some shapes 2x slower.
  static constexpr bool kNarrowScales = true;
  static __m128 narrow(const float* scales) { return _mm_loadu_ps(scales); }
  static __m128 narrow_sub_scales(const int8_t* ints, float factor) {
    int32_t four;
    std::memcpy(&four, ints, sizeof(four));
    return _mm_mul_ps(_mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(four))),
                      _mm_set1_ps(factor));
  }
  static Float spread(__m128 v) {
    const __m512i lanes = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(v));
  }
  // The wide forms (Pairs' interface): the narrow ones spread.
  static Float block_scales(const float* scales) { return spread(narrow(scales)); }
  static Float sub_scales(const int8_t* ints, float factor) {
    return spread(narrow_sub_scales(ints, factor));
  }
  static Float add(Float a, Float b) { return _mm512_add_ps(a, b); }
  static Float mul(Float a, Float b) { return _mm512_mul_ps(a, b); }
  static Float fmadd(Float a, Float b, Float c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(Float v) { return _mm512_reduce_add_ps(v); }
};
#endif

// R x TB accumulators of L's width (L::Float) for a row kernel, passed and returned by value, so
// that the compiler keeps them in registers (an array passed by reference it stores back every
// step).
template <typename L, int64_t R, int64_t TB>
struct Sums {
  typename L::Float v[R][TB];
  static Sums zero() {
    Sums s;
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t t = 0; t < TB; ++t) s.v[r][t] = typename L::Float{};
    }
    return s;
  }
};

// A row's weight scales as the row kernels read them: fp32 a group (`scales`: the weight's own,
// or widened from fp16 by quantized_row_params), or two-level a step at a time (stepwise
// below): the row's int8 scales as stored (`ints`) times their super-block's factor, widened
// where a step needs them rather than in a pass over the row first (which cost GGUF's Q4_K
// 1.5x Q4_0's time a byte), and likewise the minimums' term (two_level_offsets).
struct RowScales {
  const float* scales = nullptr;
  const int8_t* ints = nullptr;
  const float* factors = nullptr;      // [supers], fp32
  const int8_t* mins = nullptr;        // int8 minimums, or null
  const float* min_factors = nullptr;  // [supers], fp32
  int shift = 0;                       // log2 of the groups a super-block
  // Groups b .. b + L::kBlocks - 1 (each one block; within one super-block), on their lanes.
  template <typename L, bool kTwoLevel>
  typename L::Float blocks(int64_t b) const {
    if constexpr (kTwoLevel) {
      return L::sub_scales(ints + b, factors[b >> shift]);
    } else {
      return L::block_scales(scales + b);
    }
  }
  // The same one a lane in 128 bits (Quads::narrow).
  template <typename L, bool kTwoLevel>
  __m128 narrow(int64_t b) const {
    if constexpr (kTwoLevel) {
      return L::narrow_sub_scales(ints + b, factors[b >> shift]);
    } else {
      return L::narrow(scales + b);
    }
  }
};

// Whether the row kernels take w's two-level scales a step at a time: int4 in groups of 32
// (GGUF's Q4_K; int4_rows) and int8 in groups of 16 (Q6_K; sixteens_row), super-blocks of a
// power of two groups from 8 on, so that a step (2 or 4 groups) lies in one super-block and
// whole steps cover the row.
bool stepwise(const QuantizedWeight& w) {
  const int64_t S = w.super_group;
  return w.super_scales != nullptr && S >= 8 && (S & (S - 1)) == 0 &&
         ((w.format == F::kInt4 && w.group_size == kBlock) ||
          (w.format == F::kInt8 && w.group_size == kBlock / 2));
}

// `count` super-block factors of row o (P: fp32 or fp16) as fp32: the weight's own, or widened
// into out.
template <typename P>
const float* row_factors(const void* factors, int64_t o, int64_t count, float* out) {
  const P* f = static_cast<const P*>(factors) + o * count;
  if constexpr (std::is_same_v<P, float>) {
    return f;
  } else {
    int64_t s = 0;
    for (; s + 8 <= count; s += 8) {
      _mm256_storeu_ps(out + s,
                       _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(f + s))));
    }
    for (; s < count; ++s) out[s] = _cvtsh_ss(f[s].x);
    return out;
  }
}

// Row o's scales for the kernels when stepwise(w): its int8 scales and minimums as stored, its
// factors widened into buffer (2 * supers floats).
RowScales stepwise_row_scales(const QuantizedWeight& w, int64_t o, int64_t groups,
                              float* buffer) {
  const int64_t supers = groups / w.super_group;
  RowScales s;
  s.ints = static_cast<const int8_t*>(w.scales) + o * groups;
  s.shift = __builtin_ctzll(static_cast<uint64_t>(w.super_group));
  const auto widen = [&](const void* factors, float* out) {
    return w.half_params ? row_factors<c10::Half>(factors, o, supers, out)
                         : row_factors<float>(factors, o, supers, out);
  };
  s.factors = widen(w.super_scales, buffer);
  if (w.zeros != nullptr) {
    s.mins = static_cast<const int8_t*>(w.zeros) + o * groups;
    s.min_factors = widen(w.super_mins, buffer + supers);
  }
  return s;
}

// sum over groups of min factor * min * (the token's rounded input summed over the group): a
// stepwise two-level row's minimums' term, a super-block (a multiple of 8 groups) at a time.
float two_level_offsets(const RowScales& s, const float* sums, int64_t groups) {
  const int64_t S = int64_t{1} << s.shift;
  __m256 acc = _mm256_setzero_ps();
  for (int64_t begin = 0; begin < groups; begin += S) {
    __m256 part = _mm256_setzero_ps();
    for (int64_t j = begin; j < begin + S; j += 8) {
      const __m128i m = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s.mins + j));
      part = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(m)),
                             _mm256_loadu_ps(sums + j), part);
    }
    acc = _mm256_fmadd_ps(part, _mm256_set1_ps(s.min_factors[begin >> s.shift]), acc);
  }
  return sum_lanes(acc);
}
#endif  // KVSERVE_INT8_DOT_SIMD

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace kvserve::cpu
