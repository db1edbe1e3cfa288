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
//
// This file rounds the input and walks the rows; the lane types are in
// quantized_linear_int8_input_lanes.h, the row kernels in quantized_linear_int8_input_rows.h.
// The AVX512_AMX variant multiplies four tokens or more in AMX tiles instead, at any count, where
// the groups are whole blocks of 32 (quantized_linear_int8_input_tiles.h).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <limits>
#include <vector>

#include "kernels/linear/int8_rounding.h"
#include "kernels/linear/quantized_linear_int8_input_rows.h"
#include "kernels/linear/quantized_linear_int8_input_tiles.h"

namespace kvserve::cpu {
inline namespace CPU_CAPABILITY {
namespace {

// Rounds one token's k inputs: per block, d = max|x| / 127 and q = round(x * (127 / max|x|))
// (round half to even, in fp32, as quantized_linear.h states; int8_rounding.h); a block holding a
// NaN or an infinity gets q = 0 and d = NaN, so that the outputs that read it are NaN as the
// exact product's would be.
template <typename T>
void round_token(const T* x, int64_t k, int64_t g, int8_t* q, float* scale, float* group_sum) {
  int64_t b = 0;
  for (int64_t begin = 0; begin < k; begin += g) {
    float sum = 0.0f;
    for (int64_t i = begin; i < begin + g; i += kBlock, ++b) {
      const int64_t len = std::min(kBlock, begin + g - i);
      float v[kBlock];
      convert_to_float(x + i, v, len);
      bool finite;
      const float amax = abs_max(v, len, finite);
      if (!finite) {
        std::fill(q + i, q + i + len, int8_t{0});
        scale[b] = std::numeric_limits<float>::quiet_NaN();
        sum = scale[b];
        continue;
      }
      const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
      scale[b] = amax / 127.0f;
      sum += scale[b] * static_cast<float>(round_to_int8<false>(v, len, inverse, q + i));
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

// With `in_order` (the AMX tiles) q stays in input order and only the blocks' scales and the
// groups' sums are kept.
RoundedInput round_input(c10::ScalarType dtype, const void* input, int64_t stride, int64_t m,
                         const QuantizedWeight& w, bool in_order = false) {
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
      if (w.format == F::kInt4 && !in_order) interleave(q, x.blocks, x.quads);
#endif
    }
  });
  if (in_order) return x;
  if (KVSERVE_INT4_QUADS && w.format == F::kInt8 && x.blocks % 2 == 0) {
    x.lane_stride = x.blocks * 8;
    x.lane_scale.resize(m * x.lane_stride);
    for (int64_t t = 0; t < m; ++t) {
      for (int64_t b = 0; b < x.blocks; ++b) {
        std::fill_n(x.lane_scale.data() + t * x.lane_stride + b * 8, 8, x.scale[t * x.blocks + b]);
      }
    }
  }
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
  const float* xl[TB];
  for (int64_t t = 0; t < TB; ++t) {
    xq[t] = x.q.data() + (t0 + t) * k;
    xs[t] = x.scale.data() + (t0 + t) * x.blocks;
    xp[t] = x.pair_scale.data() + (t0 + t) * x.pair_stride;
    xl[t] = x.lane_scale.data() + (t0 + t) * x.lane_stride;
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
    rows_at_once(std::integral_constant<int64_t, kRowsAtOnce<f, TB>>{}, kernel);
    rows_at_once(std::integral_constant<int64_t, 1>{}, kernel);
  };
  if constexpr (f == F::kInt4) {
    const auto int4_in = [&](auto lanes) {
      all_rows([&](auto count, const uint8_t* const* row, const RowScales* scales,
                   float (*sum)[TB]) {
        constexpr int64_t R = decltype(count)::value;
        using L = decltype(lanes);
        two_level ? int4_rows<L, TB, R, true>(x, xq, xs, xp, row, scales, sum)
                  : int4_rows<L, TB, R, false>(x, xq, xs, xp, row, scales, sum);
      });
    };
#if KVSERVE_INT4_QUADS
    if (aligned && x.quads) int4_in(Quads{});
#endif
    if (aligned && x.blocks % 2 == 0 && (per_group == 1 || per_group % 2 == 0)) int4_in(Pairs{});
  } else if (aligned) {
    const auto int8_in = [&](auto lanes) {
      all_rows([&](auto count, const uint8_t* const* row, const RowScales* scales,
                   float (*sum)[TB]) {
        using L = decltype(lanes);
        int8_rows<L, TB, decltype(count)::value>(x, xq, std::is_same_v<L, Pairs> ? xs : xl, row,
                                                 scales, sum);
      });
    };
#if KVSERVE_INT4_QUADS
    // Two blocks a load where they pair up within groups (or are groups of their own).
    if (x.lane_stride > 0 && (per_group == 1 || per_group % 2 == 0)) int8_in(Quads{});
#endif
    int8_in(Pairs{});
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

// Tokens the vector kernels take at most: more run the GEMM (int8_input_tokens).
constexpr int64_t kMaxVectorTokens = 32;
#if defined(CPU_CAPABILITY_AMX)
// Tokens from which the tiles take the product where they take w: below, the vector rows. The
// tiles spend a 16 x 16 block's conversion and scaling on each 32 inputs whatever the tokens; the
// rows read the weight at up to the memory's speed. A streamed [5632, 2048] projection on an
// Emerald Rapids VM, rows against tiles (GB/s of weights): int8 at 4 / 8 / 16 tokens 13-15 / 8 /
// 4-5 against 7.4 / 8-9 / 7.5, int4 (groups of 128) 10-11 / 4.4-6 / 2-3 against 4 / 4-4.4 / 4.1.
int64_t tile_min_tokens(F f) { return f == F::kInt8 ? 8 : 16; }
#endif

int64_t int8_input_tokens(const QuantizedWeight& w) {
#if defined(CPU_CAPABILITY_AMX)
  if (tiles_take(w)) return std::numeric_limits<int64_t>::max();
#endif
  (void)w;
  return kMaxVectorTokens;
}

void quantized_gemv_int8_input_impl(c10::ScalarType dtype, const void* input,
                                    int64_t input_stride, const QuantizedWeight& w,
                                    const void* bias, void* out, int64_t m) {
  std::vector<float> y(m * w.n);
#if defined(CPU_CAPABILITY_AMX)
  if (tiles_take(w) && m >= tile_min_tokens(w.format)) {
    const RoundedInput x = round_input(dtype, input, input_stride, m, w, true);
    w.format == F::kInt8 ? tile_product<F::kInt8>(x, w, m, y.data())
                         : tile_product<F::kInt4>(x, w, m, y.data());
    KVSERVE_DISPATCH_FLOATING(dtype, [&] {
      add_bias_and_store(y.data(), static_cast<const scalar_t*>(bias),
                         static_cast<scalar_t*>(out), m, w.n);
    });
    return;
  }
#endif
  const RoundedInput x = round_input(dtype, input, input_stride, m, w);
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
KVSERVE_REGISTER_CPU_KERNEL(quantized_int8_input_tokens_stub, &int8_input_tokens);

}  // namespace CPU_CAPABILITY
}  // namespace kvserve::cpu
