#pragma once
// CUDA bodies of quantized_linear (contract: quantized_linear.h): a GEMV with one warp per output
// row and token (lanes read consecutive 4-byte words of the row, dequantize in registers and
// reduce with shuffles), and a dequantization of rows to the input dtype for the prefill GEMM
// (cuBLAS). Raw pointers only, no torch headers; the launcher checks shapes and dtypes.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "kernels/cuda_dtype.cuh"

namespace kvserve::cuda {

/// How qweight stores q: int8, int4 packed in chunks of 32 (byte j holds inputs j and j + 16),
/// or fp8 E4M3.
enum class QuantFormat : int { kInt8 = 0, kInt4 = 1, kFp8E4M3 = 2 };

/// q of the four inputs that the 4-byte word at byte `b` of a row holds, as fp32, with their input
/// indices. int8 / fp8: inputs b..b+3; int4: within its 32-input chunk, 4 low nibbles for inputs
/// j..j+3 and 4 high nibbles for j+16..j+19 (j = b % 16): eight values.
template <QuantFormat F>
__device__ inline int unpack_word(const uint8_t* row, int64_t b, float* q, int64_t* index) {
  const uint32_t word = *reinterpret_cast<const uint32_t*>(row + b);
  if constexpr (F == QuantFormat::kInt4) {
    const int64_t base = (b / 16) * 32 + b % 16;
    for (int j = 0; j < 4; ++j) {
      const uint32_t byte = (word >> (8 * j)) & 0xff;
      q[j] = static_cast<float>(byte & 0x0f);
      q[4 + j] = static_cast<float>(byte >> 4);
      index[j] = base + j;
      index[4 + j] = base + 16 + j;
    }
    return 8;
  } else {
    for (int j = 0; j < 4; ++j) {
      const uint8_t byte = static_cast<uint8_t>((word >> (8 * j)) & 0xff);
      if constexpr (F == QuantFormat::kInt8) {
        q[j] = static_cast<float>(static_cast<int8_t>(byte));
      } else {
        __nv_fp8_e4m3 v;
        v.__x = byte;
        q[j] = static_cast<float>(v);
      }
      index[j] = b + j;
    }
    return 4;
  }
}

/// Grid (ceil(n / warps per block), m), block a multiple of 32 threads. out [m, n] = input [m, k]
/// (row stride input_stride) @ dequant(q)^T + bias (nullable). Row bytes (k, or k / 2 for int4)
/// must be a multiple of 4 (the launcher falls back to the dequantizing path otherwise).
/// scales and zeros (nullable) fp32 [n, k / group_size].
template <typename T, QuantFormat F>
__global__ void quantized_gemv_kernel(const T* input, int64_t input_stride, const uint8_t* q,
                                      const float* scales, const float* zeros, const T* bias,
                                      T* out, int64_t n, int64_t k, int64_t group_size) {
  const int lane = threadIdx.x % 32;
  const int64_t o = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (o >= n) return;
  const int64_t t = blockIdx.y;
  const int64_t groups = k / group_size;
  const int64_t row_bytes = F == QuantFormat::kInt4 ? k / 2 : k;
  const uint8_t* row = q + o * row_bytes;
  const T* x = input + t * input_stride;
  float acc = 0.0f;
  for (int64_t b = 4 * lane; b < row_bytes; b += 4 * 32) {
    float values[8];
    int64_t index[8];
    const int count = unpack_word<F>(row, b, values, index);
    for (int j = 0; j < count; ++j) {
      const int64_t g = o * groups + index[j] / group_size;
      const float w = (values[j] - (zeros != nullptr ? zeros[g] : 0.0f)) * scales[g];
      acc += to_float(x[index[j]]) * w;
    }
  }
  for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_down_sync(0xffffffffu, acc, offset);
  if (lane == 0) {
    if (bias != nullptr) acc += to_float(bias[o]);
    out[t * n + o] = from_float<T>(acc);
  }
}

/// Grid (rows, ceil(row_bytes / 4 / blockDim.x)). dst [rows, k] (T) = dequant(q) rows
/// [row_begin, row_begin + rows).
template <typename T, QuantFormat F>
__global__ void quantized_dequantize_kernel(const uint8_t* q, const float* scales,
                                            const float* zeros, T* dst, int64_t row_begin,
                                            int64_t k, int64_t group_size) {
  const int64_t o = row_begin + blockIdx.x;
  const int64_t groups = k / group_size;
  const int64_t row_bytes = F == QuantFormat::kInt4 ? k / 2 : k;
  const int64_t b = 4 * (static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x);
  if (b >= row_bytes) return;
  float values[8];
  int64_t index[8];
  const int count = unpack_word<F>(q + o * row_bytes, b, values, index);
  for (int j = 0; j < count; ++j) {
    const int64_t g = o * groups + index[j] / group_size;
    const float w = (values[j] - (zeros != nullptr ? zeros[g] : 0.0f)) * scales[g];
    dst[blockIdx.x * k + index[j]] = from_float<T>(w);
  }
}

}  // namespace kvserve::cuda
