// The integer-dot body of quantized_linear (quantize_input, int8 and int4 weights), compiled once
// per CPU capability.
//
// Each token's input is rounded to int8 once per call, per block of 32 inputs of a weight group
// (quantized_linear.h), and every weight row multiplies it in integers, a block at a time: on
// AVX2, maddubs (unsigned by signed bytes, pairs summed into int16) then madd by ones (into int32
// lanes), the product llama.cpp takes between its Q8_0 activations and Q4_0 / Q8_0 weights; with
// VNNI (the AVX2_VNNI and AVX512_VNNI variants) one vpdpbusd, which sums each four products
// straight into the int32 lanes (the same sums: no int16 step to saturate). An
// int4 block is 16 bytes whose nibbles are already the unsigned operand (0..15); an int8 block
// moves the weight's sign onto the input (sign_epi8) so that |q| is the unsigned one (at most
// 2 * 128 * 127 per int16 pair: no saturation). Each block's int32 sums turn to float once and
// take the block's input scale; each group's sum takes the weight's scale; zeros come off as
// zero * scale * (the rounded input's sum over the group). No weight is ever converted to float,
// so decode is bound by reading the weight, not by unpacking it (the exact GEMV of
// quantized_linear_cpu_kernel.cpp spends ~17 vector instructions per 32 int4 weights).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <limits>
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
constexpr int64_t kPrefetchAhead = 8192;

using F = QuantFormat;

// The input of m tokens rounded to int8: q [m, k] in the input's order, the scale of each block
// [m, blocks], and (weights with zeros) the rounded input's sum over each group [m, groups].
struct RoundedInput {
  std::vector<int8_t> q;
  std::vector<float> scale, group_sum;
  // int4 weights: each pair of blocks' scales where the pair's sums have them, four lanes each
  // (int4_row), [m, pair_stride].
  std::vector<float> pair_scale;
  std::vector<int32_t> block_group;  // [blocks]: the group each block belongs to
  int64_t k = 0, blocks = 0, groups = 0, pair_stride = 0;
  // int4 on AVX-512, k a multiple of 128 in groups of 32 or of a multiple of 128: q
  // interleaved by fours of blocks (interleave), the rows taken by int4_rows as Quads.
  bool quads = false;
};

// Rounds one token's k inputs: per block, d = max|x| / 127 and q = round(x * (127 / max|x|))
// (round half to even, in fp32, as quantized_linear.h states); a block holding a NaN or an
// infinity gets q = 0 and d = NaN, so that the outputs that read it are NaN as the exact
// product's would be.
template <typename T>
void round_token(const T* x, int64_t k, int64_t g, int8_t* q, float* scale, float* group_sum) {
  int64_t b = 0;
  for (int64_t begin = 0; begin < k; begin += g) {
    float sum = 0.0f;
    for (int64_t i = begin; i < begin + g; i += kBlock, ++b) {
      const int64_t len = std::min(kBlock, begin + g - i);
      float v[kBlock];
      float amax = 0.0f;
      bool finite = true;
      for (int64_t j = 0; j < len; ++j) {
        v[j] = static_cast<float>(x[i + j]);
        finite = finite && std::isfinite(v[j]);
        amax = std::max(amax, std::fabs(v[j]));
      }
      if (!finite) {
        std::fill(q + i, q + i + len, int8_t{0});
        scale[b] = std::numeric_limits<float>::quiet_NaN();
        sum = scale[b];
        continue;
      }
      const float d = amax / 127.0f;
      const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
      int32_t block_sum = 0;
      for (int64_t j = 0; j < len; ++j) {
        const float r = std::clamp(std::nearbyint(v[j] * inverse), -127.0f, 127.0f);
        q[i + j] = static_cast<int8_t>(r);
        block_sum += q[i + j];
      }
      scale[b] = d;
      sum += d * static_cast<float>(block_sum);
    }
    if (group_sum != nullptr) group_sum[begin / g] = sum;
  }
}

#if KVSERVE_INT8_DOT_SIMD
// For int4 weights, each pair of blocks (2p, 2p + 1) of a token's q is stored as the inputs that
// one 32-byte load of the pair's packed weights unpacks to: the low nibbles (inputs 0-15 of
// block 2p, then of block 2p + 1), then the high ones (inputs 16-31 of each). With `quads`, each
// four blocks (4p .. 4p + 3) likewise for one 64-byte load: the four blocks' inputs 0-15, then
// their inputs 16-31. An odd last block keeps its order.
void interleave(int8_t* q, int64_t blocks, bool quads) {
  int8_t group[4 * kBlock];
  const auto run = [&](int64_t b, int64_t count) {
    int8_t* p = q + b * kBlock;
    for (int64_t i = 0; i < count; ++i) {
      std::copy(p + i * kBlock, p + i * kBlock + 16, group + i * 16);
      std::copy(p + i * kBlock + 16, p + (i + 1) * kBlock, group + (count + i) * 16);
    }
    std::copy(group, group + count * kBlock, p);
  };
  int64_t b = 0;
  if (quads) {
    for (; b + 4 <= blocks; b += 4) run(b, 4);
  }
  for (; b + 2 <= blocks; b += 2) run(b, 2);
}
#endif

RoundedInput round_input(c10::ScalarType dtype, const void* input, int64_t stride, int64_t m,
                         const QuantizedWeight& w) {
  RoundedInput x;
  x.k = w.k;
  x.groups = w.k / w.group_size;
  x.blocks = x.groups * ((w.group_size + kBlock - 1) / kBlock);
  x.q.resize(m * w.k);
  x.scale.resize(m * x.blocks);
  if (w.zeros != nullptr) x.group_sum.resize(m * x.groups);
  x.block_group.resize(x.blocks);
  const int64_t per_group = x.blocks / x.groups;
  for (int64_t b = 0; b < x.blocks; ++b) x.block_group[b] = static_cast<int32_t>(b / per_group);
  x.quads = KVSERVE_INT4_QUADS && w.format == F::kInt4 && x.blocks % 4 == 0 &&
            (per_group == 1 || per_group % 4 == 0);
  KVSERVE_DISPATCH_FLOATING(dtype, [&] {
    const auto* in = static_cast<const scalar_t*>(input);
    for (int64_t t = 0; t < m; ++t) {
      int8_t* q = x.q.data() + t * w.k;
      round_token(in + t * stride, w.k, w.group_size, q, x.scale.data() + t * x.blocks,
                  x.group_sum.empty() ? nullptr : x.group_sum.data() + t * x.groups);
#if KVSERVE_INT8_DOT_SIMD
      if (w.format == F::kInt4) interleave(q, x.blocks, x.quads);
#endif
    }
  });
  if (w.format == F::kInt4) {
    x.pair_stride = (x.blocks + 1) / 2 * 8;
    x.pair_scale.assign(m * x.pair_stride, 0.0f);
    for (int64_t t = 0; t < m; ++t) {
      for (int64_t b = 0; b < x.blocks; ++b) {
        std::fill_n(x.pair_scale.data() + t * x.pair_stride + b * 4, 4,
                    x.scale[t * x.blocks + b]);
      }
    }
  }
  return x;
}

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
#if defined(CPU_CAPABILITY_AVX512_VNNI)
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
  _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchAhead), _MM_HINT_T0);
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
// int4 blocks as int4_rows takes them: Pairs, two blocks from one 32-byte load (AVX2 and up);
// Quads, four from one 64-byte load (AVX-512). The tokens' inputs are interleaved to match
// (interleave) and their scales spread four lanes a block (x.pair_scale), so that a step's
// integer sums, one int32 lane for each four products, take them in one multiply: lanes 4i to
// 4i + 3 hold block i's sums.
struct Pairs {
  using Int = __m256i;
  using Float = __m256;
  static constexpr int64_t kBlocks = 2;
  static Int load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  // A step's weights unpacked: low nibbles (inputs 0-15 of each block), high ones (16-31).
  static void nibbles(const uint8_t* p, Int& lo, Int& hi) {
    const Int bytes = load(p), low = _mm256_set1_epi8(0x0f);
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
    const Int bytes = load(p), low = _mm512_set1_epi8(0x0f);
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
  static Float block_scales(const float* scales) {
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(scales)));
  }
  static Float sub_scales(const int8_t* ints, float factor) {
    int32_t four;
    std::memcpy(&four, ints, sizeof(four));
    const __m128i spread = _mm_shuffle_epi8(
        _mm_cvtsi32_si128(four), _mm_set_epi64x(0x0303030302020202, 0x0101010100000000));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(spread)),
                         _mm512_set1_ps(factor));
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
// a single token; from two tokens on, kMaxRowsAtOnce rows cut the loads of inputs per weight
// byte (int4 at four tokens: 1.3-2.8x one row at a time on a Zen 4 with AVX-512).
template <int64_t TB>
constexpr int64_t kRowsAtOnce = TB == 1 ? 1 : kMaxRowsAtOnce;

// The sums of R int4 rows times TB tokens, L::kBlocks blocks (one load a row) at a time: groups
// of 32, or of an even number of blocks (Pairs) or a multiple of four (Quads). Each token's
// inputs and input scales are loaded once a step for all R rows: those loads are three times
// the weight's bytes, and with several tokens they, not the weight's, bound a row taken alone.
// Every step's sums take its input scales times the weight scale of its blocks (groups of 32)
// or of its group in one FMA, into one accumulator per row and token, or two taken in turn
// where there are fewer than four chains.
template <typename L, int64_t TB, int64_t R, bool kTwoLevel>
void int4_rows(const RoundedInput& x, const int8_t* const* xq, const float* const* xp,
               const uint8_t* const* rows, const RowScales* scales, float (*sum)[TB]) {
  using Int = typename L::Int;
  using Float = typename L::Float;
  using Acc = Sums<L, R, TB>;
  constexpr int64_t kSets = R * TB < 4 ? 2 : 1;
  constexpr int64_t kStep = L::kBlocks;
  const int64_t blocks = x.blocks, per_group = blocks / x.groups;
  // acc plus the step of blocks from b of the R rows.
  const auto step = [&](Acc acc, int64_t b) {
    if (b % 4 == 0) {  // a cache line a row for every 4 blocks; the R rows are contiguous
      for (int64_t r = 0; r < R; ++r) prefetch_ahead(rows[0] + (b / 4 * R + r) * 64);
    }
    // The rows' weights unpacked once, then each token's inputs loaded once for all of them
    // (so that registers hold R rows' weights, not TB tokens' inputs: AVX2 has 16).
    Int lo[R], hi[R];
    Float weight[R];
    for (int64_t r = 0; r < R; ++r) {
      if constexpr (kTwoLevel) {
        weight[r] = scales[r].blocks<L, true>(b);
      } else {
        weight[r] = per_group == 1 ? scales[r].blocks<L, false>(b)
                                   : L::splat(scales[r].scales[b / per_group]);
      }
      L::nibbles(rows[r] + b * 16, lo[r], hi[r]);
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

// The sums of R int8 rows (groups a multiple of 32) times TB tokens, a block at a time: each
// token's block of inputs and its scale are loaded once for all R rows, and each row's weights
// once for all TB tokens (its sign moved onto the inputs: load_block). Each block's sums take
// its input scale; groups of one block (llama.cpp's Q8_0) the weight's scale with it, larger
// groups theirs once per group (once per row for per-channel weights): a group's sum waits on
// the FMAs before it, which for one block a group would bound the loop. One accumulator per
// row and token, or two taken in turn where there are fewer than four chains.
template <int64_t TB, int64_t R>
void int8_rows(const RoundedInput& x, const int8_t* const* xq, const float* const* xs,
               const uint8_t* const* rows, const RowScales* scales, float (*sum)[TB]) {
  constexpr int64_t kSets = R * TB < 4 ? 2 : 1;
  using Acc = Sums<Pairs, R, TB>;  // 256-bit, as Pairs
  // acc plus block b of the R rows; with_weight: its input scales times its weight scales.
  const auto block = [&](auto with_weight, Acc acc, int64_t b) {
    if (b % 2 == 0) {  // a cache line a row for every 2 blocks; the R rows are contiguous
      for (int64_t r = 0; r < R; ++r) prefetch_ahead(rows[0] + (b / 2 * R + r) * 64);
    }
    // The rows' weights loaded once, then each token's inputs once for all of them.
    WeightBlock w[R];
    __m256 weight[R];
    for (int64_t r = 0; r < R; ++r) {
      w[r] = load_block<F::kInt8>(rows[r], b * kBlock);
      if constexpr (decltype(with_weight)::value) weight[r] = _mm256_broadcast_ss(scales[r].scales + b);
    }
    for (int64_t t = 0; t < TB; ++t) {
      const __m256i in = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[t] + b * kBlock));
      const __m256 in_scale = _mm256_broadcast_ss(xs[t] + b);
      for (int64_t r = 0; r < R; ++r) {
        const __m256i dot =
            dot_add(_mm256_setzero_si256(), w[r].magnitude, _mm256_sign_epi8(in, w[r].sign));
        __m256 scale = in_scale;
        if constexpr (decltype(with_weight)::value) scale = _mm256_mul_ps(scale, weight[r]);
        acc.v[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc.v[r][t]);
      }
    }
    return acc;
  };
  Acc acc0, acc1, total;
  // Blocks [b, last) into acc0 (and acc1 in turn).
  const auto blocks = [&](auto with_weight, int64_t& b, int64_t last) {
    for (; b + kSets <= last; b += kSets) {
      acc0 = block(with_weight, acc0, b);
      if constexpr (kSets == 2) acc1 = block(with_weight, acc1, b + 1);
    }
    if (b < last) acc0 = block(with_weight, acc0, b++);
  };
  // acc0 (plus acc1) [r][t].
  const auto both = [&](int64_t r, int64_t t) {
    return kSets == 2 ? _mm256_add_ps(acc0.v[r][t], acc1.v[r][t]) : acc0.v[r][t];
  };
  acc0 = acc1 = Acc::zero();
  int64_t b = 0;
  if (x.blocks == x.groups) {  // groups of one block
    blocks(std::true_type{}, b, x.blocks);
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t t = 0; t < TB; ++t) sum[r][t] = sum_lanes(both(r, t));
    }
    return;
  }
  total = Acc::zero();
  const int64_t per_group = x.blocks / x.groups;
  for (int64_t gi = 0; gi < x.groups; ++gi) {
    blocks(std::false_type{}, b, (gi + 1) * per_group);
    for (int64_t r = 0; r < R; ++r) {
      const __m256 weight = _mm256_broadcast_ss(scales[r].scales + gi);
      for (int64_t t = 0; t < TB; ++t) {
        total.v[r][t] = _mm256_fmadd_ps(both(r, t), weight, total.v[r][t]);
      }
    }
    acc0 = acc1 = Acc::zero();
  }
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t t = 0; t < TB; ++t) sum[r][t] = sum_lanes(total.v[r][t]);
  }
}
#endif

// y[t * n + o] for TB tokens from t0 and rows [begin, end). A block's weights are loaded (and
// int4 unpacked) once for all TB tokens. Groups that are multiples of 32 run through int4_rows /
// int8_rows (int4_row the int4 shapes those do not take); int8 groups of 16 (GGUF's Q6_K)
// through sixteens_row; other int8 groups with a shorter last block go a group at a time, the
// short block in scalar code.
template <F f, bool kZero, int64_t TB>
void rows_for_tokens(const RoundedInput& x, int64_t t0, const QuantizedWeight& w, int64_t begin,
                     int64_t end, float* params, float* y) {
  const int64_t k = w.k, g = w.group_size, groups = x.groups;
  const int64_t per_group = (g + kBlock - 1) / kBlock;
  const int64_t row_bytes = byte_offset<f>(k);
  const bool aligned = g % kBlock == 0;
  const bool sixteens = f == F::kInt8 && g == kBlock / 2;  // Q6_K's sub-blocks
  const auto* q = static_cast<const uint8_t*>(w.q);
  const int8_t* xq[TB];
  const float* xs[TB];
  const float* xp[TB];
  for (int64_t t = 0; t < TB; ++t) {
    xq[t] = x.q.data() + (t0 + t) * k;
    xs[t] = x.scale.data() + (t0 + t) * x.blocks;
    xp[t] = x.pair_scale.data() + (t0 + t) * x.pair_stride;
  }
  // Row o's outputs: its sums less its zeros' part (p's, or stepwise two-level minimums').
  const auto store = [&](int64_t o, const QuantizedRowParams& p, const auto& scales,
                         const float* sum) {
    for (int64_t t = 0; t < TB; ++t) {
      float out = sum[t];
      if constexpr (kZero) {
        const float* sums = x.group_sum.data() + (t0 + t) * groups;
#if KVSERVE_INT8_DOT_SIMD
        if (scales.mins != nullptr) {
          out -= two_level_offsets(scales, sums, groups);
        } else
#endif
        if (p.offsets != nullptr) {
          out -= group_dot(p.offsets, sums, groups);
        } else if (w.shared_zero) {
          out -= p.zeros[0] * group_dot(p.scales, sums, groups);
        } else {
          out -= zero_part(p.zeros, p.scales, sums, groups);
        }
      }
      y[(t0 + t) * w.n + o] = out;
    }
  };
  int64_t o = begin;
#if KVSERVE_INT8_DOT_SIMD
  const bool two_level = stepwise(w);
  // Row o's scales as its kernel reads them (and p its parameters for store), in buffer.
  const auto row_scales = [&](int64_t o, float* buffer, QuantizedRowParams& p) {
    if (two_level) return stepwise_row_scales(w, o, groups, buffer);
    p = quantized_row_params(w, o, groups, buffer);
    RowScales s;
    s.scales = p.scales;
    return s;
  };
  // Rows `count` at a time through kernel(count, rows, scales, sums) while they last.
  const auto rows_at_once = [&](auto count, const auto& kernel) {
    constexpr int64_t R = decltype(count)::value;
    for (; o + R <= end; o += R) {
      QuantizedRowParams p[R] = {};
      RowScales scales[R];
      const uint8_t* row[R];
      for (int64_t r = 0; r < R; ++r) {
        scales[r] = row_scales(o + r, params + r * 2 * groups, p[r]);
        row[r] = q + (o + r) * row_bytes;
      }
      float sum[R][TB];
      kernel(count, row, scales, sum);
      for (int64_t r = 0; r < R; ++r) store(o + r, p[r], scales[r], sum[r]);
    }
  };
  // All rows: kRowsAtOnce at a time, then one at a time.
  const auto all_rows = [&](const auto& kernel) {
    rows_at_once(std::integral_constant<int64_t, kRowsAtOnce<TB>>{}, kernel);
    rows_at_once(std::integral_constant<int64_t, 1>{}, kernel);
  };
  if constexpr (f == F::kInt4) {
    const auto int4_in = [&](auto lanes) {
      all_rows([&](auto count, const uint8_t* const* row, const RowScales* scales,
                   float (*sum)[TB]) {
        constexpr int64_t R = decltype(count)::value;
        using L = decltype(lanes);
        two_level ? int4_rows<L, TB, R, true>(x, xq, xp, row, scales, sum)
                  : int4_rows<L, TB, R, false>(x, xq, xp, row, scales, sum);
      });
    };
#if KVSERVE_INT4_QUADS
    if (aligned && x.quads) int4_in(Quads{});
#endif
    if (aligned && x.blocks % 2 == 0 && (per_group == 1 || per_group % 2 == 0)) int4_in(Pairs{});
  } else if (aligned) {
    all_rows([&](auto count, const uint8_t* const* row, const RowScales* scales,
                 float (*sum)[TB]) {
      int8_rows<TB, decltype(count)::value>(x, xq, xs, row, scales, sum);
    });
  }
#endif
  for (; o < end; ++o) {
    const uint8_t* row = q + o * row_bytes;
    QuantizedRowParams p = {};
#if KVSERVE_INT8_DOT_SIMD
    const RowScales row_scale = row_scales(o, params, p);
#else
    p = quantized_row_params(w, o, groups, params);
    struct {
      const int8_t* mins = nullptr;
    } row_scale;
#endif
    const float* scales = p.scales;
    float sum[TB] = {};
#if KVSERVE_INT8_DOT_SIMD
    if (sixteens) {
      // int8 groups (and blocks) of 16: four a 64-byte load (AVX-512), two a 32-byte one, an
      // odd last one in scalar code (never stepwise: its super-blocks are whole steps).
      const auto in = [&](auto lanes, int64_t b) {
        using L = decltype(lanes);
        return two_level ? sixteens_row<L, TB, true>(xq, xs, row, row_scale, b, groups, sum)
                         : sixteens_row<L, TB, false>(xq, xs, row, row_scale, b, groups, sum);
      };
      int64_t b = 0;
#if KVSERVE_INT4_QUADS
      b = in(Quads{}, b);
#endif
      b = in(Pairs{}, b);
      for (; b < groups; ++b) {
        for (int64_t t = 0; t < TB; ++t) {
          sum[t] += xs[t][b] * scales[b] * static_cast<float>(dot_scalar<f>(row, xq[t], b * 16, 16));
        }
      }
    } else if (aligned) {  // int4 rows int4_rows does not take (int8's all went through int8_rows)
      int4_row<TB>(x, xq, xs, xp, row, scales, sum);
    }
#endif
    if (!KVSERVE_INT8_DOT_SIMD || (!aligned && !sixteens)) {
      for (int64_t gi = 0; gi < groups; ++gi) {
        const int64_t group_end = (gi + 1) * g;
        float part[TB] = {};
        for (int64_t i = gi * g, b = gi * per_group; i < group_end; i += kBlock, ++b) {
          const int64_t len = std::min(kBlock, group_end - i);
#if KVSERVE_INT8_DOT_SIMD
          if (len == kBlock) {
            const WeightBlock weights = load_block<f>(row, i);
            for (int64_t t = 0; t < TB; ++t) {
              part[t] += xs[t][b] * static_cast<float>(sum_lanes_int(dot_block<f>(weights,
                                                                                 xq[t] + i)));
            }
            continue;
          }
#endif
          for (int64_t t = 0; t < TB; ++t) {
            part[t] += xs[t][b] * static_cast<float>(dot_scalar<f>(row, xq[t], i, len));
          }
        }
        for (int64_t t = 0; t < TB; ++t) sum[t] += part[t] * scales[gi];
      }
    }
    store(o, p, row_scale, sum);
  }
}

template <F f, bool kZero>
void gemv_format(const RoundedInput& x, const QuantizedWeight& w, int64_t m, float* y) {
  at::parallel_for(0, w.n, kRowGrain, [&](int64_t begin, int64_t end) {
    // The fp16 or two-level scales and zeros of the rows taken at once widened
    // (quantized_row_params), or a shared zero, allocated once per task.
    std::vector<float> buffer = quantized_row_params_buffer(w, x.groups, kMaxRowsAtOnce);
    float* params = buffer.data();
    for (int64_t r0 = begin; r0 < end; r0 += kRowTile) {
      const int64_t r1 = std::min(end, r0 + kRowTile);
      for (int64_t t0 = 0; t0 < m; t0 += kTokenBlock) {
        switch (std::min(kTokenBlock, m - t0)) {
          case 1: rows_for_tokens<f, kZero, 1>(x, t0, w, r0, r1, params, y); break;
          case 2: rows_for_tokens<f, kZero, 2>(x, t0, w, r0, r1, params, y); break;
          case 3: rows_for_tokens<f, kZero, 3>(x, t0, w, r0, r1, params, y); break;
          default: rows_for_tokens<f, kZero, 4>(x, t0, w, r0, r1, params, y); break;
        }
      }
    }
  });
}

void quantized_gemv_int8_input_impl(c10::ScalarType dtype, const void* input,
                                    int64_t input_stride, const QuantizedWeight& w,
                                    const void* bias, void* out, int64_t m) {
  const RoundedInput x = round_input(dtype, input, input_stride, m, w);
  std::vector<float> y(m * w.n);
  const bool zero = w.zeros != nullptr;
  switch (w.format) {
    case F::kInt8:
      zero ? gemv_format<F::kInt8, true>(x, w, m, y.data())
           : gemv_format<F::kInt8, false>(x, w, m, y.data());
      break;
    case F::kInt4:
      zero ? gemv_format<F::kInt4, true>(x, w, m, y.data())
           : gemv_format<F::kInt4, false>(x, w, m, y.data());
      break;
    default: TORCH_CHECK(false, "quantized_linear: quantize_input takes int8 or int4 weights");
  }
  KVSERVE_DISPATCH_FLOATING(dtype, [&] {
    add_bias_and_store(y.data(), static_cast<const scalar_t*>(bias),
                       static_cast<scalar_t*>(out), m, w.n);
  });
}

}  // namespace

KVSERVE_REGISTER_CPU_KERNEL(quantized_gemv_int8_input_stub, &quantized_gemv_int8_input_impl);

}  // namespace CPU_CAPABILITY
}  // namespace kvserve::cpu
