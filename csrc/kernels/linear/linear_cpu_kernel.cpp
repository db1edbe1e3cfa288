// Streaming GEMV body for a few tokens: each thread owns a contiguous range of output features
// and reads those weight rows once, sequentially, keeping the (small) input in cache. Register
// blocks of kRowBlock weight rows x up to kTokenBlock tokens give independent FMA chains.
// Compiled once per CPU capability.
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include "kernels/cpu_kernels.h"
#include "kernels/cpu_vec.h"

namespace kvserve::cpu {
inline namespace CPU_CAPABILITY {
namespace {

constexpr int64_t kRowBlock = 8;    // weight rows per register block (4 for 3-4 tokens)
constexpr int64_t kTokenBlock = 4;  // tokens per register block (weight read once per block)
constexpr int64_t kPrefetchBytes = 4096;  // software prefetch distance along each weight row

float reduce(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

#if defined(CPU_CAPABILITY_AVX512)
// bf16 weights on AVX-512: one 64-byte load holds 32 weights; unpacking against zero turns them
// into two fp32 vectors (a bf16 is the top half of an fp32) in a lane order that the input is
// pre-permuted to match, so the loop does no shifts or conversions. The dot product does not care
// about the order of its terms.
constexpr int64_t kBf16Chunk = 32;

// x [tokens, k] fp32 -> the same values with each full 32-element chunk reordered to
// [unpacklo lanes | unpackhi lanes]; the tail keeps its order.
void permute_for_bf16_unpack(std::vector<float>& x, int64_t tokens, int64_t k) {
  float chunk[kBf16Chunk];
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t c = 0; c + kBf16Chunk <= k; c += kBf16Chunk) {
      float* src = x.data() + t * k + c;
      for (int64_t lane = 0; lane < 4; ++lane) {
        for (int64_t j = 0; j < 4; ++j) {
          chunk[lane * 4 + j] = src[lane * 8 + j];           // unpacklo half of each lane
          chunk[16 + lane * 4 + j] = src[lane * 8 + 4 + j];  // unpackhi half
        }
      }
      std::copy(chunk, chunk + kBf16Chunk, src);
    }
  }
}

template <int64_t R, int64_t TB>
void block_dot_bf16(const float* x, const c10::BFloat16* w, int64_t k, float* out, int64_t n) {
  __m512 acc[TB][R];
  for (int64_t t = 0; t < TB; ++t)
    for (int64_t r = 0; r < R; ++r) acc[t][r] = _mm512_setzero_ps();
  const __m512i zero = _mm512_setzero_si512();
  int64_t i = 0;
  for (; i + kBf16Chunk <= k; i += kBf16Chunk) {
    __m512 lo[R], hi[R];
    for (int64_t r = 0; r < R; ++r) {
      __builtin_prefetch(reinterpret_cast<const char*>(w + r * k + i) + kPrefetchBytes);
      const __m512i raw = _mm512_loadu_si512(w + r * k + i);
      lo[r] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, raw));
      hi[r] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, raw));
    }
    for (int64_t t = 0; t < TB; ++t) {
      const __m512 xlo = _mm512_loadu_ps(x + t * k + i), xhi = _mm512_loadu_ps(x + t * k + i + 16);
      for (int64_t r = 0; r < R; ++r) {
        acc[t][r] = _mm512_fmadd_ps(xlo, lo[r], acc[t][r]);
        acc[t][r] = _mm512_fmadd_ps(xhi, hi[r], acc[t][r]);
      }
    }
  }
  for (int64_t t = 0; t < TB; ++t) {
    for (int64_t r = 0; r < R; ++r) {
      float sum = _mm512_reduce_add_ps(acc[t][r]);
      for (int64_t j = i; j < k; ++j) sum += x[t * k + j] * static_cast<float>(w[r * k + j]);
      out[t * n + r] = sum;
    }
  }
}
#endif

// out[t][r] (fp32, stride n) = dot(x[t], w[r]) for R weight rows and exactly TB tokens. Both are
// compile-time constants so that the TB x R accumulators stay in registers.
template <typename T, int64_t R, int64_t TB>
void block_dot(const float* x, const T* w, int64_t k, float* out, int64_t n) {
  Vec acc[TB][R];
  for (int64_t t = 0; t < TB; ++t)
    for (int64_t r = 0; r < R; ++r) acc[t][r] = Vec(0.0f);
  int64_t i = 0;
  for (; i + Vec::size() <= k; i += Vec::size()) {
    Vec wv[R];
    for (int64_t r = 0; r < R; ++r) {
      __builtin_prefetch(reinterpret_cast<const char*>(w + r * k + i) + kPrefetchBytes);
      wv[r] = load_as_float(w + r * k + i);
    }
    for (int64_t t = 0; t < TB; ++t) {
      const Vec xv = Vec::loadu(x + t * k + i);
      for (int64_t r = 0; r < R; ++r) acc[t][r] = at::vec::fmadd(xv, wv[r], acc[t][r]);
    }
  }
  for (int64_t t = 0; t < TB; ++t) {
    for (int64_t r = 0; r < R; ++r) {
      float sum = reduce(acc[t][r]);
      for (int64_t j = i; j < k; ++j) sum += x[t * k + j] * static_cast<float>(w[r * k + j]);
      out[t * n + r] = sum;
    }
  }
}

// Output rows [row_begin, row_end) for TB tokens.
// One token, bf16: rows in storage order, so each thread reads one sequential stream, with
// kChains independent accumulators to hide the FMA latency. On this path that beats interleaving
// 8 rows (measured ~1.0 vs ~0.6 of torch.sum's read bandwidth); for fp32 the 8-row block wins.
constexpr int64_t kChains = 8;

#if defined(CPU_CAPABILITY_AVX512)
float row_dot_bf16(const float* x, const c10::BFloat16* w, int64_t k) {
  __m512 acc[kChains];
  for (int64_t c = 0; c < kChains; ++c) acc[c] = _mm512_setzero_ps();
  const __m512i zero = _mm512_setzero_si512();
  constexpr int64_t kStep = kChains / 2 * kBf16Chunk;  // each chunk feeds two chains
  int64_t i = 0;
  for (; i + kStep <= k; i += kStep) {
    __builtin_prefetch(reinterpret_cast<const char*>(w + i) + kPrefetchBytes);
    for (int64_t c = 0; c < kChains / 2; ++c) {
      const int64_t at = i + c * kBf16Chunk;
      const __m512i raw = _mm512_loadu_si512(w + at);
      acc[2 * c] = _mm512_fmadd_ps(_mm512_loadu_ps(x + at),
                                   _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, raw)), acc[2 * c]);
      acc[2 * c + 1] = _mm512_fmadd_ps(_mm512_loadu_ps(x + at + 16),
                                       _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, raw)),
                                       acc[2 * c + 1]);
    }
  }
  for (; i + kBf16Chunk <= k; i += kBf16Chunk) {
    const __m512i raw = _mm512_loadu_si512(w + i);
    acc[0] = _mm512_fmadd_ps(_mm512_loadu_ps(x + i),
                             _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, raw)), acc[0]);
    acc[1] = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 16),
                             _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, raw)), acc[1]);
  }
  for (int64_t c = 1; c < kChains; ++c) acc[0] = _mm512_add_ps(acc[0], acc[c]);
  float sum = _mm512_reduce_add_ps(acc[0]);
  for (; i < k; ++i) sum += x[i] * static_cast<float>(w[i]);
  return sum;
}
#endif

template <typename T, int64_t TB>
void rows_for_tokens(const float* x, const T* weight, int64_t k, int64_t row_begin,
                     int64_t row_end, float* y, int64_t n) {
  // Enough independent weight streams and FMA chains to keep loads in flight, few enough that the
  // TB x R accumulators fit the 32 vector registers.
  constexpr int64_t R = TB <= 2 ? kRowBlock : kRowBlock / 2;
  int64_t r = row_begin;
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if constexpr (TB == 1) {
      for (; r < row_end; ++r) y[r] = row_dot_bf16(x, weight + r * k, k);
      return;
    }
    for (; r + R <= row_end; r += R) block_dot_bf16<R, TB>(x, weight + r * k, k, y + r, n);
    for (; r < row_end; ++r) block_dot_bf16<1, TB>(x, weight + r * k, k, y + r, n);
    return;
  }
#endif
  for (; r + R <= row_end; r += R) block_dot<T, R, TB>(x, weight + r * k, k, y + r, n);
  for (; r < row_end; ++r) block_dot<T, 1, TB>(x, weight + r * k, k, y + r, n);
}

template <typename T>
void gemv_typed(const T* input, int64_t input_stride, const T* weight, const T* bias, T* out,
                int64_t m, int64_t n, int64_t k) {
  // The input in fp32 once; the fp32 result once, converted at the end.
  std::vector<float> x(m * k), y(m * n);
  for (int64_t t = 0; t < m; ++t) convert_to_float(input + t * input_stride, x.data() + t * k, k);
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, c10::BFloat16>) permute_for_bf16_unpack(x, m, k);
#endif
  const int64_t blocks = (n + kRowBlock - 1) / kRowBlock;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    const int64_t row_begin = begin * kRowBlock, row_end = std::min(n, end * kRowBlock);
    for (int64_t t0 = 0; t0 < m; t0 += kTokenBlock) {
      const float* xt = x.data() + t0 * k;
      float* yt = y.data() + t0 * n;
      switch (std::min(kTokenBlock, m - t0)) {
        case 1: rows_for_tokens<T, 1>(xt, weight, k, row_begin, row_end, yt, n); break;
        case 2: rows_for_tokens<T, 2>(xt, weight, k, row_begin, row_end, yt, n); break;
        case 3: rows_for_tokens<T, 3>(xt, weight, k, row_begin, row_end, yt, n); break;
        default: rows_for_tokens<T, 4>(xt, weight, k, row_begin, row_end, yt, n); break;
      }
    }
  });
  for (int64_t t = 0; t < m; ++t) {
    float* row = y.data() + t * n;
    if (bias != nullptr) {
      for (int64_t j = 0; j < n; ++j) row[j] += static_cast<float>(bias[j]);
    }
    convert_from_float(row, out + t * n, n);
  }
}

void gemv_impl(c10::ScalarType dtype, const void* input, int64_t input_stride, const void* weight,
               const void* bias, void* out, int64_t m, int64_t n, int64_t k) {
  KVSERVE_DISPATCH_FLOATING(dtype, [&] {
    gemv_typed(static_cast<const scalar_t*>(input), input_stride,
               static_cast<const scalar_t*>(weight), static_cast<const scalar_t*>(bias),
               static_cast<scalar_t*>(out), m, n, k);
  });
}

}  // namespace

KVSERVE_REGISTER_CPU_KERNEL(gemv_stub, &gemv_impl);

}  // namespace CPU_CAPABILITY
}  // namespace kvserve::cpu
