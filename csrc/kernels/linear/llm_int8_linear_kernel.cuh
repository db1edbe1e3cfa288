#pragma once
// CUDA bodies of LLM.int8() (contract: llm_int8_linear.h), in three passes:
//  1. split: one warp per token finds its outliers (|x| >= threshold), lists their columns in
//     ascending order, and rounds the rest to int8 with the token's scale;
//  2. the integer product: int32 dot products of int8 weight rows with the int8 activations, one
//     warp per output row reading it once for up to kInt8GemvTokens tokens, four int8 pairs per
//     lane step through __dp4a (for many tokens the launcher runs cuBLAS instead);
//  3. epilogue: one thread per (token, output) scales the integer sum, adds the token's outlier
//     columns in fp32 in ascending order, then the bias.
// The same operations, in the same order, as the CPU launcher: a token's result does not depend
// on its batch. Raw pointers only, no torch headers; the launcher checks shapes and dtypes.

#include <cstdint>

#include "kernels/cuda_dtype.cuh"
#include "kernels/cuda_reduce.cuh"

namespace kvserve::cuda {

/// Grid ceil(m / warps per block), block a multiple of 32 threads. For token t (row of input
/// [m, k], row stride input_stride): outliers are the |x| >= threshold when split_outliers;
/// scale = max |x| over the rest / 127; xq int8 [m, k] = round_half_even(x / scale), clamped to
/// +-127 (0 for outliers; scale 0 divides by 1); row_scale fp32 [m] = scale. With
/// split_outliers, num_outliers int32 [m] and outlier_columns int32 [m, k] (the first
/// num_outliers[t] entries of row t, ascending); both may be null without.
template <typename T>
__global__ void llm_int8_split_kernel(const T* input, int64_t input_stride, int64_t m, int64_t k,
                                      bool split_outliers, float threshold, int8_t* xq,
                                      float* row_scale, int32_t* num_outliers,
                                      int32_t* outlier_columns) {
  const int lane = threadIdx.x % 32;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (t >= m) return;  // whole warps leave together
  const T* x = input + t * input_stride;
  const auto is_outlier = [&](float v) { return split_outliers && fabsf(v) >= threshold; };
  float amax = 0.0f;
  for (int64_t j = lane; j < k; j += 32) {
    const float v = to_float(x[j]);
    if (!is_outlier(v)) amax = fmaxf(amax, fabsf(v));
  }
  const float scale = warp_max(amax) / 127.0f;
  const float safe = scale > 0.0f ? scale : 1.0f;
  int32_t count = 0;
  for (int64_t base = 0; base < k; base += 32) {
    const int64_t j = base + lane;
    const float v = j < k ? to_float(x[j]) : 0.0f;
    const bool outlier = j < k && is_outlier(v);
    if (j < k) {
      // fminf / fmaxf also map a NaN to a number: no undefined float-to-int conversion.
      const float q = fminf(fmaxf(rintf(v / safe), -127.0f), 127.0f);
      xq[t * k + j] = outlier ? 0 : static_cast<int8_t>(q);
    }
    const unsigned int ballot = __ballot_sync(0xffffffffu, outlier);
    if (outlier) {
      const int before = __popc(ballot & ((1u << lane) - 1u));
      outlier_columns[t * k + count + before] = static_cast<int32_t>(j);
    }
    count += __popc(ballot);
  }
  if (lane == 0) {
    row_scale[t] = scale;
    if (num_outliers != nullptr) num_outliers[t] = count;
  }
}

/// Tokens one warp of int8_gemm_kernel multiplies with each weight row it reads.
constexpr int kInt8GemvTokens = 8;

/// Grid (ceil(n / warps per block), ceil(m / kInt8GemvTokens)), block a multiple of 32 threads.
/// out [m, n] int32 = x [m, k] int8 @ w [n, k]^T int8, both contiguous. `aligned`: x and w start
/// at multiples of 4 and k is one (4-byte loads and __dp4a); else byte loads.
__global__ void int8_gemm_kernel(const int8_t* x, const int8_t* w, int32_t* out, int64_t m,
                                 int64_t n, int64_t k, bool aligned) {
  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= n) return;
  const int64_t t0 = static_cast<int64_t>(blockIdx.y) * kInt8GemvTokens;
  const int tokens = static_cast<int>(m - t0 < kInt8GemvTokens ? m - t0 : kInt8GemvTokens);
  int32_t acc[kInt8GemvTokens] = {};
  if (aligned) {
    const auto* ww = reinterpret_cast<const int32_t*>(w + row * k);
    for (int64_t i = lane; i < k / 4; i += 32) {
      const int32_t wv = ww[i];
#pragma unroll
      for (int t = 0; t < kInt8GemvTokens; ++t) {
        if (t < tokens) {
          acc[t] = __dp4a(reinterpret_cast<const int32_t*>(x + (t0 + t) * k)[i], wv, acc[t]);
        }
      }
    }
  } else {
    for (int64_t i = lane; i < k; i += 32) {
      const int32_t wv = w[row * k + i];
#pragma unroll
      for (int t = 0; t < kInt8GemvTokens; ++t) {
        if (t < tokens) acc[t] += static_cast<int32_t>(x[(t0 + t) * k + i]) * wv;
      }
    }
  }
#pragma unroll
  for (int t = 0; t < kInt8GemvTokens; ++t) {
    if (t >= tokens) break;
    int32_t sum = acc[t];
    for (int offset = 16; offset > 0; offset /= 2) {
      sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    }
    if (lane == 0) out[(t0 + t) * n + row] = sum;
  }
}

/// Grid (ceil(n / blockDim.x), up to m; blocks stride over the tokens). out [m, n] (T,
/// contiguous)[t, o] = acc[t, o] * row_scale[t] * w_scales[o], plus, for the outlier columns j of
/// token t in ascending order (none when num_outliers is null), input[t, j] * (w[o, j] *
/// w_scales[o]), plus bias[o] (nullable); each step rounded to fp32 as the CPU launcher rounds
/// it (no fused multiply-add). input: [m, k] with row stride input_stride; w int8 [n, k].
template <typename T>
__global__ void llm_int8_epilogue_kernel(const int32_t* acc, const float* row_scale,
                                         const float* w_scales, const T* input,
                                         int64_t input_stride, const int8_t* w,
                                         const int32_t* num_outliers,
                                         const int32_t* outlier_columns, const T* bias, T* out,
                                         int64_t m, int64_t n, int64_t k) {
  const int64_t o = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (o >= n) return;
  const float ws = w_scales[o];
  for (int64_t t = blockIdx.y; t < m; t += gridDim.y) {
    float y = __fmul_rn(__fmul_rn(static_cast<float>(acc[t * n + o]), row_scale[t]), ws);
    const int32_t count = num_outliers != nullptr ? num_outliers[t] : 0;
    for (int32_t i = 0; i < count; ++i) {
      const int64_t j = outlier_columns[t * k + i];
      const float column = __fmul_rn(static_cast<float>(w[o * k + j]), ws);
      y = __fadd_rn(y, __fmul_rn(to_float(input[t * input_stride + j]), column));
    }
    if (bias != nullptr) y = __fadd_rn(y, to_float(bias[o]));
    out[t * n + o] = from_float<T>(y);
  }
}

}  // namespace kvserve::cuda
