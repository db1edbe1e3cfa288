// Bodies of quantized_linear (int8, int4, fp8 E4M3 weights): the decode GEMV, and the row
// dequantization that feeds the prefill GEMM; compiled once per CPU capability.
//
// A weight row is read once, in chunks of 32 inputs. Each chunk becomes 32 / Vec::size() fp32
// vectors of q in registers, in whatever lane order the cheapest unpacking gives: int4 broadcasts
// its 16 bytes to every 128-bit lane and shifts each lane by its own amount, int8 (AVX2)
// sign-extends each byte of a 32-bit lane with two shifts, so neither needs a shuffle. The input
// is permuted once per call to the same order (chunk_order). The products q * x accumulate per
// group and are scaled at the group's end; the zero point comes off as zero * scale * sum(x).
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <vector>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include "kernels/cpu_kernels.h"
#include "kernels/cpu_vec.h"

namespace kvserve::cpu {
inline namespace CPU_CAPABILITY {
namespace {

constexpr int64_t kChunk = 32;                   // inputs per unpacked chunk
constexpr int64_t kLanes = Vec::size();
constexpr int64_t kVecs = kChunk / kLanes;       // fp32 vectors per chunk
constexpr int64_t kTokenBlock = 4;               // tokens per pass over the weight
constexpr int64_t kRowGrain = 16;                // output rows per parallel task at least

using F = QuantFormat;

// The fp8 loaders decode E4M3 as the fp16 with the same sign, exponent and mantissa bits one
// place lower (exact, subnormals included, no branches), which is the value / 256: the 256 goes
// into the scale.
template <F f>
constexpr float kScaleFactor = f == F::kFp8E4M3 ? 256.0f : 1.0f;

// Bytes of a row before input i (i a multiple of 32 for int4).
template <F f>
int64_t byte_offset(int64_t i) {
  return f == F::kInt4 ? i / 2 : i;
}

// q at input i of a row, in the natural order (fp8: the value / 256): the tails of groups that
// are not a multiple of 32 (int8 and fp8 only), and the capability without vector code.
template <F f>
float load_one(const uint8_t* row, int64_t i) {
  if constexpr (f == F::kInt8) {
    return static_cast<float>(static_cast<int8_t>(row[i]));
  } else if constexpr (f == F::kInt4) {
    const int64_t j = i % kChunk;
    const uint8_t byte = row[(i - j) / 2 + j % 16];
    return static_cast<float>(j < 16 ? byte & 0x0f : byte >> 4);
  } else {
    return fp8_e4m3_over_256(row[i]);
  }
}

// The input of a chunk that lane position j (vector j / kLanes, lane j % kLanes) holds.
template <F f>
constexpr int64_t chunk_order(int64_t j) {
  const int64_t v = j / kLanes, lane = j % kLanes;
#if defined(CPU_CAPABILITY_AVX512)
  if (f == F::kInt4) {  // quarter of the register lane / 4 takes nibble 4v + quarter of its word
    const int64_t nibble = 4 * v + lane / 4;
    return (nibble % 2 ? 16 : 0) + 4 * (lane % 4) + nibble / 2;
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if (f == F::kInt4) {  // half lane / 4 takes byte v of its word: low nibbles, then high ones
    return (lane / 4 ? 16 : 0) + 4 * (lane % 4) + v;
  }
  if (f == F::kInt8) return 4 * lane + v;  // vector v: byte v of each 32-bit lane
#endif
  (void)v, (void)lane;
  return j;
}

template <F f>
constexpr std::array<int64_t, kChunk> kChunkOrder = [] {
  std::array<int64_t, kChunk> order{};
  for (int64_t j = 0; j < kChunk; ++j) order[j] = chunk_order<f>(j);
  return order;
}();

// The 32 q values of the chunk starting at input i of a row, in chunk_order.
template <F f>
void load_chunk(const uint8_t* row, int64_t i, Vec* out) {
  const uint8_t* p = row + byte_offset<f>(i);
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (f == F::kInt8) {
    for (int64_t v = 0; v < kVecs; ++v) {
      out[v] = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * v))));
    }
  } else if constexpr (f == F::kInt4) {
    const __m512i words =
        _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512i mask = _mm512_set1_epi32(0x0f);
    for (int64_t v = 0; v < kVecs; ++v) {
      const __m512i shift = _mm512_set_epi32(
          4 * (4 * v + 3), 4 * (4 * v + 3), 4 * (4 * v + 3), 4 * (4 * v + 3), 4 * (4 * v + 2),
          4 * (4 * v + 2), 4 * (4 * v + 2), 4 * (4 * v + 2), 4 * (4 * v + 1), 4 * (4 * v + 1),
          4 * (4 * v + 1), 4 * (4 * v + 1), 16 * v, 16 * v, 16 * v, 16 * v);
      out[v] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(words, shift), mask));
    }
  } else {
    const __m256i keep = _mm256_set1_epi16(static_cast<int16_t>(0xbfff));
    for (int64_t v = 0; v < kVecs; ++v) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * v));
      const __m256i u = _mm256_slli_epi16(_mm256_cvtepu8_epi16(raw), 8);
      out[v] = _mm512_cvtph_ps(_mm256_and_si256(_mm256_srai_epi16(u, 1), keep));
    }
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (f == F::kInt8) {
    const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    out[0] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(words, 24), 24));
    out[1] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(words, 16), 24));
    out[2] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(words, 8), 24));
    out[3] = _mm256_cvtepi32_ps(_mm256_srai_epi32(words, 24));
  } else if constexpr (f == F::kInt4) {
    const __m256i words =
        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i mask = _mm256_set1_epi32(0x0f);
    for (int64_t v = 0; v < kVecs; ++v) {
      const int b = static_cast<int>(8 * v);
      const __m256i shift = _mm256_set_epi32(b + 4, b + 4, b + 4, b + 4, b, b, b, b);
      out[v] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(words, shift), mask));
    }
  } else {
    const __m128i zero = _mm_setzero_si128();
    const __m128i keep = _mm_set1_epi16(static_cast<int16_t>(0xbfff));
    for (int64_t v = 0; v < kVecs; ++v) {
      const __m128i u =
          _mm_unpacklo_epi8(zero, _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * v)));
      out[v] = _mm256_cvtph_ps(_mm_and_si128(_mm_srai_epi16(u, 1), keep));
    }
  }
#else
  float q[kChunk];
  for (int64_t j = 0; j < kChunk; ++j) q[j] = load_one<f>(row, i + kChunkOrder<f>[j]);
  for (int64_t v = 0; v < kVecs; ++v) out[v] = Vec::loadu(q + v * kLanes);
#endif
}

// Full chunks start at each group's start and every 32 inputs after it; a group's inputs after
// its last full chunk (int8 / fp8 only) keep their place.
template <F f>
void order_impl(const QuantizedWeight& w, int64_t* order) {
  for (int64_t begin = 0; begin < w.k; begin += w.group_size) {
    const int64_t end = begin + w.group_size;
    int64_t i = begin;
    for (; i + kChunk <= end; i += kChunk) {
      for (int64_t j = 0; j < kChunk; ++j) order[i + j] = i + kChunkOrder<f>[j];
    }
    for (; i < end; ++i) order[i] = i;
  }
}

float reduce(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

// y[t * n + o] = dot(x[t], dequant(w)[o]) for TB tokens and rows [begin, end); x fp32 [TB, k] in
// quantized order, xsum [TB, groups] the sums of each token's groups (with zeros only). Plain
// loops and locals, so that the accumulators stay in registers: one per vector of a chunk for a
// single token (independent FMA chains), two per token for more (a chunk unpacked once serves
// every token of the block; TB x 2 accumulators, the chunk and an input fit 16 registers).
template <F f, bool kZero, int64_t TB>
void rows_for_tokens(const float* x, const float* xsum, const QuantizedWeight& w, int64_t begin,
                     int64_t end, float* y) {
  const int64_t k = w.k, g = w.group_size, groups = k / g;
  const int64_t row_bytes = byte_offset<f>(k);
  const auto* q = static_cast<const uint8_t*>(w.q);
  std::vector<float> params = quantized_row_params_buffer(w, groups);
  for (int64_t o = begin; o < end; ++o) {
    const uint8_t* row = q + o * row_bytes;
    const QuantizedRowParams p =
        quantized_row_params(w, o, groups, params.data());
    const float* scales = p.scales;
    Vec total[TB];
    float tail[TB] = {};
    for (int64_t t = 0; t < TB; ++t) total[t] = Vec(0.0f);
    constexpr int64_t A = TB == 1 ? kVecs : (kVecs < 2 ? kVecs : 2);  // accumulators per token
    for (int64_t gi = 0; gi < groups; ++gi) {
      Vec acc[TB][A];
      float part[TB] = {};
      for (int64_t t = 0; t < TB; ++t)
        for (int64_t a = 0; a < A; ++a) acc[t][a] = Vec(0.0f);
      const int64_t group_end = (gi + 1) * g;
      int64_t i = gi * g;
      for (; i + kChunk <= group_end; i += kChunk) {
        Vec qv[kVecs];
        load_chunk<f>(row, i, qv);
        for (int64_t t = 0; t < TB; ++t) {
          for (int64_t v = 0; v < kVecs; ++v) {
            acc[t][v % A] =
                at::vec::fmadd(Vec::loadu(x + t * k + i + v * kLanes), qv[v], acc[t][v % A]);
          }
        }
      }
      for (; i < group_end; ++i) {  // int8 / fp8 groups that are not a multiple of 32
        const float qi = load_one<f>(row, i);
        for (int64_t t = 0; t < TB; ++t) part[t] += x[t * k + i] * qi;
      }
      const float s = scales[gi] * kScaleFactor<f>;
      const Vec scale(s);
      for (int64_t t = 0; t < TB; ++t) {
        Vec sum = acc[t][0];
        for (int64_t a = 1; a < A; ++a) sum = sum + acc[t][a];
        total[t] = at::vec::fmadd(sum, scale, total[t]);
        tail[t] += part[t] * s;
      }
    }
    for (int64_t t = 0; t < TB; ++t) {
      float zero_part = 0.0f;  // sum over groups of zero * scale * sum(x of the group)
      if constexpr (kZero) {
        const float* zeros = p.zeros;
        const float* offsets = p.offsets;  // two-level: the zero terms as they are
        const float* sums = xsum + t * groups;
        Vec part(0.0f);
        int64_t gi = 0;
        for (; gi + kLanes <= groups; gi += kLanes) {
          const Vec term = offsets != nullptr ? Vec::loadu(offsets + gi)
                                              : Vec::loadu(zeros + gi) * Vec::loadu(scales + gi);
          part = at::vec::fmadd(term, Vec::loadu(sums + gi), part);
        }
        zero_part = reduce(part);
        for (; gi < groups; ++gi) {
          zero_part += (offsets != nullptr ? offsets[gi] : zeros[gi] * scales[gi]) * sums[gi];
        }
      }
      y[t * w.n + o] = reduce(total[t]) + tail[t] - zero_part;
    }
  }
}

template <F f, bool kZero>
void gemv_format(const float* x, const float* xsum, const QuantizedWeight& w, int64_t m, float* y) {
  const int64_t groups = w.k / w.group_size;
  at::parallel_for(0, w.n, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t0 = 0; t0 < m; t0 += kTokenBlock) {
      const float* xt = x + t0 * w.k;
      const float* st = xsum + t0 * groups;
      float* yt = y + t0 * w.n;
      switch (std::min(kTokenBlock, m - t0)) {
        case 1: rows_for_tokens<f, kZero, 1>(xt, st, w, begin, end, yt); break;
        case 2: rows_for_tokens<f, kZero, 2>(xt, st, w, begin, end, yt); break;
        case 3: rows_for_tokens<f, kZero, 3>(xt, st, w, begin, end, yt); break;
        default: rows_for_tokens<f, kZero, 4>(xt, st, w, begin, end, yt); break;
      }
    }
  });
}

// Runs body.template operator()<format, has_zeros>() for the weight's format.
template <typename Body>
void dispatch_format(const QuantizedWeight& w, Body&& body) {
  const bool zero = w.zeros != nullptr;
  switch (w.format) {
    case F::kInt8:
      return zero ? body.template operator()<F::kInt8, true>()
                  : body.template operator()<F::kInt8, false>();
    case F::kInt4:
      return zero ? body.template operator()<F::kInt4, true>()
                  : body.template operator()<F::kInt4, false>();
    case F::kFp8E4M3:
      TORCH_CHECK(!zero, "quantized_linear: fp8 weights take no zeros");
      return body.template operator()<F::kFp8E4M3, false>();
  }
  TORCH_CHECK(false, "quantized_linear: unknown weight format");
}

void quantized_order_impl(const QuantizedWeight& w, int64_t* order) {
  dispatch_format(w, [&]<F f, bool>() { order_impl<f>(w, order); });
}

void quantized_gemv_impl(c10::ScalarType dtype, const void* input, int64_t input_stride,
                         const QuantizedWeight& w, const void* bias, void* out, int64_t m) {
  const int64_t k = w.k, groups = k / w.group_size;
  std::vector<int64_t> order(k);
  quantized_order_impl(w, order.data());
  KVSERVE_DISPATCH_FLOATING(dtype, [&] {
    const auto* in = static_cast<const scalar_t*>(input);
    // The input in fp32 and in quantized order once, with its group sums; the fp32 result.
    std::vector<float> plain(k), x(m * k), xsum(w.zeros != nullptr ? m * groups : 0), y(m * w.n);
    for (int64_t t = 0; t < m; ++t) {
      convert_to_float(in + t * input_stride, plain.data(), k);
      for (int64_t i = 0; i < k; ++i) x[t * k + i] = plain[order[i]];
      for (int64_t g = 0; g < static_cast<int64_t>(xsum.size()) / m; ++g) {
        float sum = 0.0f;
        for (int64_t i = g * w.group_size; i < (g + 1) * w.group_size; ++i) sum += plain[i];
        xsum[t * groups + g] = sum;
      }
    }
    dispatch_format(w, [&]<F f, bool kZero>() {
      gemv_format<f, kZero>(x.data(), xsum.data(), w, m, y.data());
    });
    add_bias_and_store(y.data(), static_cast<const scalar_t*>(bias),
                       static_cast<scalar_t*>(out), m, w.n);
  });
}

template <F f, bool kZero>
void dequantize_rows(const QuantizedWeight& w, int64_t row_begin, int64_t row_end, float* dst) {
  const int64_t k = w.k, groups = k / w.group_size;
  const int64_t row_bytes = byte_offset<f>(k);
  const auto* q = static_cast<const uint8_t*>(w.q);
  at::parallel_for(row_begin, row_end, kRowGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> params = quantized_row_params_buffer(w, groups);
    for (int64_t o = begin; o < end; ++o) {
      const uint8_t* row = q + o * row_bytes;
      float* out = dst + (o - row_begin) * k;
      const QuantizedRowParams p =
          quantized_row_params(w, o, groups, params.data());
      for (int64_t gi = 0; gi < groups; ++gi) {
        const float s = p.scales[gi] * kScaleFactor<f>;
        int64_t i = gi * w.group_size;
        const int64_t group_end = i + w.group_size;
        if (kZero && p.offsets != nullptr) {  // two-level: q * scale - offset
          const float c = p.offsets[gi];
          const Vec scale(s), offset(c);
          for (; i + kChunk <= group_end; i += kChunk) {
            Vec qv[kVecs];
            load_chunk<f>(row, i, qv);
            for (int64_t v = 0; v < kVecs; ++v) {
              at::vec::fmsub(qv[v], scale, offset).store(out + i + v * kLanes);
            }
          }
          for (; i < group_end; ++i) out[i] = load_one<f>(row, i) * s - c;
          continue;
        }
        const float z = kZero ? p.zeros[gi] : 0.0f;
        const Vec scale(s), zero(z);
        for (; i + kChunk <= group_end; i += kChunk) {
          Vec qv[kVecs];
          load_chunk<f>(row, i, qv);
          for (int64_t v = 0; v < kVecs; ++v) {
            ((kZero ? qv[v] - zero : qv[v]) * scale).store(out + i + v * kLanes);
          }
        }
        for (; i < group_end; ++i) out[i] = (load_one<f>(row, i) - z) * s;
      }
    }
  });
}

void quantized_dequantize_impl(const QuantizedWeight& w, int64_t row_begin, int64_t row_end,
                               float* dst) {
  dispatch_format(w, [&]<F f, bool kZero>() {
    dequantize_rows<f, kZero>(w, row_begin, row_end, dst);
  });
}

}  // namespace

KVSERVE_REGISTER_CPU_KERNEL(quantized_gemv_stub, &quantized_gemv_impl);
KVSERVE_REGISTER_CPU_KERNEL(quantized_order_stub, &quantized_order_impl);
KVSERVE_REGISTER_CPU_KERNEL(quantized_dequantize_stub, &quantized_dequantize_impl);

}  // namespace CPU_CAPABILITY
}  // namespace kvserve::cpu
