#pragma once
// CUDA bodies of rms_norm and fused_add_rms_norm (contract: rms_norm.h): one block per token,
// fp32 sum of squares reduced over the block, one rounding of x * rsqrt(mean + eps) * w. A thread
// keeps its kPerThread values of the row in registers, loaded all at once, so a row costs one
// memory round trip before the reduction (kPerThread 0: rows too wide for that, read twice).
// Raw pointers only, no torch headers; the launcher checks shapes and dtypes.

#include <cstdint>
#include <type_traits>

#include "kernels/cuda_dtype.cuh"
#include "kernels/cuda_reduce.cuh"

namespace kvserve::cuda {

/// Block size and values per thread (1, 2, 4, 8 or 16; 0 past 16 x 1024) for rows of `hidden`.
struct NormPlan {
  int threads, per_thread;
};
inline NormPlan norm_plan(int64_t hidden) {
  constexpr int64_t kMaxThreads = 1024, kTargetThreads = 512, kMaxPerThread = 16;
  if (hidden > kMaxThreads * kMaxPerThread) return {static_cast<int>(kMaxThreads), 0};
  int per_thread = 1;
  while (per_thread < kMaxPerThread && per_thread * kTargetThreads < hidden) per_thread *= 2;
  const int64_t threads = ((hidden + per_thread - 1) / per_thread + 31) / 32 * 32;
  return {static_cast<int>(threads), per_thread};
}

/// Calls f(std::integral_constant<int, P>{}) for the plan's P = per_thread.
template <typename F>
inline void dispatch_per_thread(int per_thread, F&& f) {
  switch (per_thread) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    case 16: f(std::integral_constant<int, 16>{}); break;
    default: f(std::integral_constant<int, 0>{}); break;
  }
}

/// Grid (num_tokens), block norm_plan(hidden).threads (a multiple of 32) with kPerThread its
/// per_thread. W is T or float (Gemma's fp32 1 + w). In place (out == input) is allowed.
template <typename T, typename W, int kPerThread>
__global__ void rms_norm_kernel(T* out, int64_t out_stride, const T* input, int64_t input_stride,
                                const W* weight, int64_t hidden, float epsilon) {
  __shared__ float scratch[32];
  const T* x = input + blockIdx.x * input_stride;
  T* y = out + blockIdx.x * out_stride;
  float sum = 0.0f;
  if constexpr (kPerThread == 0) {
    for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
      const float v = to_float(x[i]);
      sum += v * v;
    }
    const float scale = rsqrtf(block_sum(sum, scratch) / static_cast<float>(hidden) + epsilon);
    for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
      y[i] = from_float<T>(to_float(x[i]) * scale * to_float(weight[i]));
    }
  } else {
    float v[kPerThread], w[kPerThread];
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int64_t i = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
      v[j] = i < hidden ? to_float(x[i]) : 0.0f;
      w[j] = i < hidden ? to_float(weight[i]) : 0.0f;  // loaded before the reduction's wait
      sum += v[j] * v[j];
    }
    const float scale = rsqrtf(block_sum(sum, scratch) / static_cast<float>(hidden) + epsilon);
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int64_t i = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
      if (i < hidden) y[i] = from_float<T>(v[j] * scale * w[j]);
    }
  }
}

/// Grid (num_tokens), block as for rms_norm_kernel. In place: residual = round(residual +
/// input), then input = rms_norm(residual) * weight.
template <typename T, typename W, int kPerThread>
__global__ void fused_add_rms_norm_kernel(T* input, int64_t input_stride, T* residual,
                                          int64_t residual_stride, const W* weight,
                                          int64_t hidden, float epsilon) {
  __shared__ float scratch[32];
  T* x = input + blockIdx.x * input_stride;
  T* r = residual + blockIdx.x * residual_stride;
  float sum = 0.0f;
  if constexpr (kPerThread == 0) {
    for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
      const T rounded = from_float<T>(to_float(r[i]) + to_float(x[i]));
      r[i] = rounded;
      const float v = to_float(rounded);
      sum += v * v;
    }
    const float scale = rsqrtf(block_sum(sum, scratch) / static_cast<float>(hidden) + epsilon);
    // Each thread reads back only the residual entries it wrote itself: no barrier needed.
    for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
      x[i] = from_float<T>(to_float(r[i]) * scale * to_float(weight[i]));
    }
  } else {
    float v[kPerThread], w[kPerThread];
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int64_t i = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
      v[j] = i < hidden ? to_float(r[i]) + to_float(x[i]) : 0.0f;
      w[j] = i < hidden ? to_float(weight[i]) : 0.0f;  // loaded before the reduction's wait
    }
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int64_t i = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
      if (i < hidden) {
        const T rounded = from_float<T>(v[j]);
        r[i] = rounded;
        v[j] = to_float(rounded);
      }
      sum += v[j] * v[j];
    }
    const float scale = rsqrtf(block_sum(sum, scratch) / static_cast<float>(hidden) + epsilon);
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int64_t i = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
      if (i < hidden) x[i] = from_float<T>(v[j] * scale * w[j]);
    }
  }
}

}  // namespace kvserve::cuda
