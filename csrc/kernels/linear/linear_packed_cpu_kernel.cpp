// Streaming GEMV body for a few tokens over a weight in oneDNN's packed layout
// (linear_packed_layout.h): the GEMM's own copy of the weight, so no second copy is kept. Blocks
// of B output features are contiguous and a thread owns whole blocks, reading each once,
// sequentially. Inside a block one input's B weights are adjacent: the kernel broadcasts x[t][i]
// and accumulates B outputs per token in registers, with no horizontal sums. bf16 pairs
// (W[o][2j], W[o][2j+1]) share a 32-bit word: a shift and a mask turn them into fp32 exactly.
// Compiled once per CPU capability.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include "kernels/cpu_kernels.h"
#include "kernels/cpu_vec.h"

namespace kvserve::cpu {
inline namespace CPU_CAPABILITY {
namespace {

constexpr int64_t kVS = Vec::size();
constexpr int64_t kPrefetchBytes = 2048;  // ahead along the block's sequential stream

// Vec::size() packed bf16 pairs -> the even inputs' and the odd inputs' weights, fp32.
inline void unpack_pairs(const c10::BFloat16* p, Vec& even, Vec& odd) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i raw = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(0xFFFF0000u)));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(0xFFFF0000u)));
#else
  float e[kVS], o[kVS];
  for (int64_t j = 0; j < kVS; ++j) {
    e[j] = static_cast<float>(p[2 * j]);
    o[j] = static_cast<float>(p[2 * j + 1]);
  }
  even = Vec::loadu(e);
  odd = Vec::loadu(o);
#endif
}

// y[t * ldy + [0, V * kVS)] = sum_i x[t][i] * W[block][i] for TB tokens, fp32 weights (P = 1).
template <int64_t V, int64_t TB>
void block_fp32(const float* x, int64_t ldx, int64_t k, const float* w, float* y, int64_t ldy) {
  constexpr int64_t B = V * kVS;
  Vec acc[TB][V];
  for (int64_t t = 0; t < TB; ++t)
    for (int64_t v = 0; v < V; ++v) acc[t][v] = Vec(0.0f);
  for (int64_t i = 0; i < k; ++i, w += B) {
    Vec wv[V];
    for (int64_t v = 0; v < V; ++v) {
      __builtin_prefetch(reinterpret_cast<const char*>(w + v * kVS) + kPrefetchBytes);
      wv[v] = Vec::loadu(w + v * kVS);
    }
    for (int64_t t = 0; t < TB; ++t) {
      const Vec xt(x[t * ldx + i]);
      for (int64_t v = 0; v < V; ++v) acc[t][v] = at::vec::fmadd(wv[v], xt, acc[t][v]);
    }
  }
  for (int64_t t = 0; t < TB; ++t)
    for (int64_t v = 0; v < V; ++v) acc[t][v].store(y + t * ldy + v * kVS);
}

// The same for bf16 weights in pairs (P = 2). An odd k's last pair uses its even half only (the
// odd half is padding).
template <int64_t V, int64_t TB>
void block_bf16(const float* x, int64_t ldx, int64_t k, const c10::BFloat16* w, float* y,
                int64_t ldy) {
  constexpr int64_t B = V * kVS;
  // The odd inputs accumulate apart while registers allow: two FMA chains per output vector.
  constexpr bool kSplit = TB * V <= 8;
  Vec acc[TB][V], acc_odd[kSplit ? TB : 1][kSplit ? V : 1];
  for (int64_t t = 0; t < TB; ++t)
    for (int64_t v = 0; v < V; ++v) acc[t][v] = Vec(0.0f);
  if constexpr (kSplit) {
    for (int64_t t = 0; t < TB; ++t)
      for (int64_t v = 0; v < V; ++v) acc_odd[t][v] = Vec(0.0f);
  }
  const int64_t pairs = k / 2;
  for (int64_t j = 0; j < pairs; ++j, w += 2 * B) {
    Vec even[V], odd[V];
    for (int64_t v = 0; v < V; ++v) {
      __builtin_prefetch(reinterpret_cast<const char*>(w + 2 * v * kVS) + kPrefetchBytes);
      unpack_pairs(w + 2 * v * kVS, even[v], odd[v]);
    }
    for (int64_t t = 0; t < TB; ++t) {
      const Vec x0(x[t * ldx + 2 * j]), x1(x[t * ldx + 2 * j + 1]);
      for (int64_t v = 0; v < V; ++v) {
        acc[t][v] = at::vec::fmadd(even[v], x0, acc[t][v]);
        if constexpr (kSplit) {
          acc_odd[t][v] = at::vec::fmadd(odd[v], x1, acc_odd[t][v]);
        } else {
          acc[t][v] = at::vec::fmadd(odd[v], x1, acc[t][v]);
        }
      }
    }
  }
  if (k % 2 == 1) {
    for (int64_t v = 0; v < V; ++v) {
      Vec even, odd;
      unpack_pairs(w + 2 * v * kVS, even, odd);
      for (int64_t t = 0; t < TB; ++t) {
        acc[t][v] = at::vec::fmadd(even, Vec(x[t * ldx + k - 1]), acc[t][v]);
      }
    }
  }
  if constexpr (kSplit) {
    for (int64_t t = 0; t < TB; ++t)
      for (int64_t v = 0; v < V; ++v) acc[t][v] = acc[t][v] + acc_odd[t][v];
  }
  for (int64_t t = 0; t < TB; ++t)
    for (int64_t v = 0; v < V; ++v) acc[t][v].store(y + t * ldy + v * kVS);
}

// The most tokens a register block holds: TB x V accumulators, V weight vectors and a broadcast
// in the vector registers. fp32 blocks on AVX-512 (32 registers) take up to 8 tokens, so a
// verification's 5-9 tokens read the block's weights once or twice; elsewhere (bf16 splits its
// FMA chains, AVX2 has 16 registers) 4, or 2 when a block needs 8 vectors per token.
template <typename T, int64_t V>
constexpr int64_t max_token_block() {
  if (std::is_same_v<T, float> && kVS == 16) return std::min<int64_t>(8, (32 - 1 - V) / V);
  return V >= 8 ? 2 : 4;
}

template <typename T, int64_t V, int64_t TB>
void run_block(const float* x, int64_t ldx, int64_t k, const T* w, float* y, int64_t ldy) {
  if constexpr (std::is_same_v<T, float>) {
    block_fp32<V, TB>(x, ldx, k, w, y, ldy);
  } else {
    block_bf16<V, TB>(x, ldx, k, w, y, ldy);
  }
}

// One block's outputs for every token (token t's at y + t * ldy), in register blocks of up to
// max_token_block() tokens. x holds the tokens' inputs, ldx apart.
template <typename T, int64_t V>
void block_all_tokens(const float* x, int64_t ldx, int64_t m, int64_t k, const T* w, float* y,
                      int64_t ldy) {
  constexpr int64_t kMaxTB = max_token_block<T, V>();
  for (int64_t t0 = 0; t0 < m; t0 += kMaxTB) {
    const float* xt = x + t0 * ldx;
    float* yt = y + t0 * ldy;
    const int64_t tokens = std::min<int64_t>(kMaxTB, m - t0);
    auto run = [&](auto tb) {
      constexpr int64_t TB = decltype(tb)::value;
      if constexpr (TB <= kMaxTB) {
        if (tokens == TB) run_block<T, V, TB>(xt, ldx, k, w, yt, ldy);
      }
    };
    run(std::integral_constant<int64_t, 1>{});
    run(std::integral_constant<int64_t, 2>{});
    run(std::integral_constant<int64_t, 3>{});
    run(std::integral_constant<int64_t, 4>{});
    run(std::integral_constant<int64_t, 5>{});
    run(std::integral_constant<int64_t, 6>{});
    run(std::integral_constant<int64_t, 7>{});
    run(std::integral_constant<int64_t, 8>{});
  }
}

template <typename T>
void gemv_packed_typed(const T* input, int64_t input_stride, const T* weight, const T* bias,
                       T* out, int64_t m, int64_t n, int64_t k, int64_t block_out,
                       int64_t k_padded) {
  // fp32 reads its input rows in place and writes every whole block of outputs into `out`; a
  // bf16 input is converted to fp32 once and its fp32 result converted at the end.
  constexpr bool kFloat = std::is_same_v<T, float>;
  std::vector<float> x_buffer(kFloat ? 0 : m * k), y_buffer(kFloat ? 0 : m * n);
  const float* x;
  float* y;
  int64_t ldx;
  if constexpr (kFloat) {
    x = input;
    y = out;
    ldx = input_stride;
  } else {
    for (int64_t t = 0; t < m; ++t) {
      convert_to_float(input + t * input_stride, x_buffer.data() + t * k, k);
    }
    x = x_buffer.data();
    y = y_buffer.data();
    ldx = k;
  }
  const int64_t blocks = (n + block_out - 1) / block_out;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> tile;  // a last block whose outputs pass n
    for (int64_t b = begin; b < end; ++b) {
      const T* w = weight + b * k_padded * block_out;
      const int64_t o0 = b * block_out, count = std::min(block_out, n - o0);
      const bool whole = count == block_out;
      if (!whole) tile.resize(m * block_out);
      float* yb = whole ? y + o0 : tile.data();
      const int64_t ldy = whole ? n : block_out;
      switch (block_out / kVS) {
        case 1: block_all_tokens<T, 1>(x, ldx, m, k, w, yb, ldy); break;
        case 2: block_all_tokens<T, 2>(x, ldx, m, k, w, yb, ldy); break;
        case 3: block_all_tokens<T, 3>(x, ldx, m, k, w, yb, ldy); break;
        case 4: block_all_tokens<T, 4>(x, ldx, m, k, w, yb, ldy); break;
        case 6: block_all_tokens<T, 6>(x, ldx, m, k, w, yb, ldy); break;
        case 8: block_all_tokens<T, 8>(x, ldx, m, k, w, yb, ldy); break;
        default: TORCH_CHECK(false, "gemv_packed: unsupported block of ", block_out, " outputs");
      }
      if (!whole) {
        for (int64_t t = 0; t < m; ++t) {
          std::memcpy(y + t * n + o0, tile.data() + t * block_out, count * sizeof(float));
        }
      }
    }
  });
  for (int64_t t = 0; t < m; ++t) {
    float* row = y + t * n;
    if (bias != nullptr) {
      for (int64_t j = 0; j < n; ++j) row[j] += static_cast<float>(bias[j]);
    }
    if constexpr (!kFloat) convert_from_float(row, out + t * n, n);
  }
}

void gemv_packed_impl(c10::ScalarType dtype, const void* input, int64_t input_stride,
                      const void* weight, const void* bias, void* out, int64_t m, int64_t n,
                      int64_t k, int64_t block_out, int64_t k_padded) {
  if (dtype == c10::kFloat) {
    gemv_packed_typed(static_cast<const float*>(input), input_stride,
                      static_cast<const float*>(weight), static_cast<const float*>(bias),
                      static_cast<float*>(out), m, n, k, block_out, k_padded);
  } else {
    TORCH_CHECK(dtype == c10::kBFloat16, "gemv_packed: fp32 or bf16 weights only");
    using T = c10::BFloat16;
    gemv_packed_typed(static_cast<const T*>(input), input_stride, static_cast<const T*>(weight),
                      static_cast<const T*>(bias), static_cast<T*>(out), m, n, k, block_out,
                      k_padded);
  }
}

}  // namespace

KVSERVE_REGISTER_CPU_KERNEL(gemv_packed_stub, &gemv_packed_impl);

}  // namespace CPU_CAPABILITY
}  // namespace kvserve::cpu
