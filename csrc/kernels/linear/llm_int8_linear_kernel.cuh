#pragma once
// CUDA body of LLM.int8()'s integer product (contract: llm_int8_linear.h): int32 dot products of
// int8 weight rows with int8 activations, one warp per (output row, token), four int8 pairs per
// lane step through __dp4a, reduced with shuffles. The launcher does the outlier split, the
// per-token rounding (elementwise) and the scaling around it, as the CPU launcher does. Raw
// pointers only, no torch headers.

#include <cstdint>

namespace kvserve::cuda {

/// Grid (ceil(n / warps per block), m), block a multiple of 32 threads. out [m, n] int32 =
/// x [m, k] int8 @ w [n, k]^T int8, both contiguous; k a multiple of 4 (the launcher pads).
__global__ void int8_gemm_kernel(const int8_t* x, const int8_t* w, int32_t* out, int64_t n,
                                 int64_t k) {
  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int64_t token = blockIdx.y;
  if (row >= n) return;
  const auto* xw = reinterpret_cast<const int32_t*>(x + token * k);
  const auto* ww = reinterpret_cast<const int32_t*>(w + row * k);
  int32_t acc = 0;
  for (int64_t i = lane; i < k / 4; i += 32) acc = __dp4a(xw[i], ww[i], acc);
  for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_down_sync(0xffffffffu, acc, offset);
  if (lane == 0) out[token * n + row] = acc;
}

}  // namespace kvserve::cuda
