#pragma once
// Warp and block reductions for the CUDA kernel bodies: fp32 sums and maxima, and generic ones
// (any op, several sums at once) for other types. Block reductions need every thread of the block
// (a multiple of 32, at most 1024) and a shared scratch array of 32 values (32 * N for N sums).

#include <cfloat>

namespace kvserve::cuda {

__device__ inline float warp_sum(float x) {
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

__device__ inline float warp_max(float x) {
  for (int offset = 16; offset > 0; offset /= 2) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  }
  return x;
}

/// The sum of x over the block, returned to every thread. `scratch`: __shared__ float[32].
__device__ inline float block_sum(float x, float* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = (blockDim.x + 31) / 32;
  x = warp_sum(x);
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  x = lane < warps ? scratch[lane] : 0.0f;
  return warp_sum(x);
}

/// The maximum of x over the block, returned to every thread. `scratch`: __shared__ float[32].
__device__ inline float block_max(float x, float* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = (blockDim.x + 31) / 32;
  x = warp_max(x);
  __syncthreads();
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  x = lane < warps ? scratch[lane] : -FLT_MAX;
  return warp_max(x);
}

/// The reduction of x by `op` (commutative and associative, e.g. a max) over the warp, returned to
/// every lane. T: any type __shfl_xor_sync takes (int, int64_t, uint64_t, double, ...). Each step
/// combines the same two values on both lanes, so every lane ends with the same bits.
template <typename T, typename Op>
__device__ inline T warp_reduce(T x, Op op) {
  for (int offset = 16; offset > 0; offset /= 2) x = op(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

/// The reduction of x by `op` over the block, returned to every thread (the same bits on all);
/// `identity` stands in for the lanes past the last warp. `scratch`: __shared__ T[32].
template <typename T, typename Op>
__device__ inline T block_reduce(T x, Op op, T identity, T* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = (blockDim.x + 31) / 32;
  x = warp_reduce(x, op);
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  return warp_reduce(lane < warps ? scratch[lane] : identity, op);
}

/// The N sums of v[0..N) over the block, written back to v on every thread (the same bits on all),
/// with one pair of barriers for all N (histograms). T: float, double, int, int64_t.
/// `scratch`: __shared__ T[32 * N].
template <int N, typename T>
__device__ inline void block_sum_n(T (&v)[N], T* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = (blockDim.x + 31) / 32;
  const auto add = [](T a, T b) { return a + b; };
#pragma unroll
  for (int j = 0; j < N; ++j) v[j] = warp_reduce(v[j], add);
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) {
#pragma unroll
    for (int j = 0; j < N; ++j) scratch[warp * N + j] = v[j];
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < N; ++j) v[j] = warp_reduce(lane < warps ? scratch[lane * N + j] : T(0), add);
}

}  // namespace kvserve::cuda
