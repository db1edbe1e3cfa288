#pragma once
// CUDA bodies of quantized_linear (contract: quantized_linear.h): a GEMV with one warp per output
// row that reads the row once for all of a few tokens (lanes read consecutive 4-byte words,
// dequantize in registers and reduce with shuffles), and a dequantization of rows to the input
// dtype for the prefill GEMM (cuBLAS). fused_moe_quantized's body reuses the row dot product.
// Raw pointers only, no torch headers; the launcher checks shapes and dtypes.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "kernels/cuda_dtype.cuh"
#include "kernels/cuda_reduce.cuh"

namespace kvserve::cuda {

/// How qweight stores q: int8, int4 packed in chunks of 32 (byte j holds inputs j and j + 16),
/// or fp8 E4M3.
enum class QuantFormat : int { kInt8 = 0, kInt4 = 1, kFp8E4M3 = 2 };

/// Bytes of one weight row of k inputs.
template <QuantFormat F>
__host__ __device__ inline int64_t quantized_row_bytes(int64_t k) {
  return F == QuantFormat::kInt4 ? k / 2 : k;
}

/// The bytes b..b+3 of a row of row_bytes bytes, little-endian, zero past the row's end: one
/// 4-byte load when `aligned` (the row starts at a multiple of 4 and row_bytes is one), else
/// byte loads (int8 / fp8 rows of k % 4 != 0 inputs, or a weight view at an odd address).
__device__ inline uint32_t load_word(const uint8_t* row, int64_t b, int64_t row_bytes,
                                     bool aligned) {
  if (aligned) return *reinterpret_cast<const uint32_t*>(row + b);
  uint32_t word = 0;
  for (int j = 0; j < 4 && b + j < row_bytes; ++j) {
    word |= static_cast<uint32_t>(row[b + j]) << (8 * j);
  }
  return word;
}

/// q of the inputs that the word at byte `b` of a row holds, as fp32, with their input indices;
/// returns how many. int8 / fp8: inputs b..b+3 (fewer at the row's end); int4: within its
/// 32-input chunk, 4 low nibbles for inputs j..j+3 and 4 high nibbles for j+16..j+19
/// (j = b % 16): eight values (int4 rows are whole chunks, so never cut).
template <QuantFormat F>
__device__ inline int unpack_word(const uint8_t* row, int64_t b, int64_t row_bytes, bool aligned,
                                  float* q, int64_t* index) {
  const uint32_t word = load_word(row, b, row_bytes, aligned);
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
    const int count = row_bytes - b < 4 ? static_cast<int>(row_bytes - b) : 4;
    for (int j = 0; j < count; ++j) {
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
    return count;
  }
}

/// One lane's share of x_t . dequant(q)[o] for the m <= kTokens rows x_t = x + t * x_stride:
/// acc[t] += over the words 4 * lane, 4 * (lane + 32), ... of row o (the caller reduces over the
/// warp). q: [n, row bytes of k]; scales / zeros (nullable): fp32 [n, k / group_size].
template <QuantFormat F, int kTokens, typename X>
__device__ inline void quantized_row_dot(const X* x, int64_t x_stride, int m, const uint8_t* q,
                                         const float* scales, const float* zeros, int64_t o,
                                         int64_t k, int64_t group_size, bool aligned, int lane,
                                         float* acc) {
  const int64_t groups = k / group_size, row_bytes = quantized_row_bytes<F>(k);
  const uint8_t* row = q + o * row_bytes;
  const float* s = scales + o * groups;
  const float* z = zeros != nullptr ? zeros + o * groups : nullptr;
  for (int64_t b = 4 * lane; b < row_bytes; b += 4 * 32) {
    float values[8];
    int64_t index[8];
    const int count = unpack_word<F>(row, b, row_bytes, aligned, values, index);
    for (int j = 0; j < count; ++j) {
      const int64_t g = index[j] / group_size;
      const float w = (values[j] - (z != nullptr ? z[g] : 0.0f)) * s[g];
#pragma unroll
      for (int t = 0; t < kTokens; ++t) {
        if (t < m) acc[t] += to_float(x[t * x_stride + index[j]]) * w;
      }
    }
  }
}

/// Tokens one GEMV launch takes at most (the launcher splits more into launches).
constexpr int kQuantizedGemvTokens = 8;

/// Grid ceil(n / warps per block), block a multiple of 32 threads. out [m, n] = input [m, k]
/// (row stride input_stride), m <= kQuantizedGemvTokens, @ dequant(q)^T + bias (nullable): each
/// warp reads its weight row once for all m tokens. scales and zeros (nullable) fp32
/// [n, k / group_size]; `aligned`: q starts at a multiple of 4 and its rows are whole words.
template <typename T, QuantFormat F>
__global__ void quantized_gemv_kernel(const T* input, int64_t input_stride, int m,
                                      const uint8_t* q, const float* scales, const float* zeros,
                                      const T* bias, T* out, int64_t n, int64_t k,
                                      int64_t group_size, bool aligned) {
  const int lane = threadIdx.x % 32;
  const int64_t o = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (o >= n) return;  // whole warps leave together
  float acc[kQuantizedGemvTokens] = {};
  quantized_row_dot<F, kQuantizedGemvTokens>(input, input_stride, m, q, scales, zeros, o, k,
                                             group_size, aligned, lane, acc);
#pragma unroll
  for (int t = 0; t < kQuantizedGemvTokens; ++t) {
    if (t >= m) break;
    const float sum = warp_sum(acc[t]);
    if (lane == 0) out[t * n + o] = from_float<T>(bias != nullptr ? sum + to_float(bias[o]) : sum);
  }
}

/// Grid (rows, ceil(row_bytes / 4 / blockDim.x)). dst [rows, k] (T, contiguous, inputs in their
/// natural order) = dequant(q) rows [row_begin, row_begin + rows). `aligned` as for the GEMV.
template <typename T, QuantFormat F>
__global__ void quantized_dequantize_kernel(const uint8_t* q, const float* scales,
                                            const float* zeros, T* dst, int64_t row_begin,
                                            int64_t k, int64_t group_size, bool aligned) {
  const int64_t o = row_begin + blockIdx.x;
  const int64_t groups = k / group_size, row_bytes = quantized_row_bytes<F>(k);
  const int64_t b = 4 * (static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x);
  if (b >= row_bytes) return;
  float values[8];
  int64_t index[8];
  const int count = unpack_word<F>(q + o * row_bytes, b, row_bytes, aligned, values, index);
  for (int j = 0; j < count; ++j) {
    const int64_t g = o * groups + index[j] / group_size;
    const float w = (values[j] - (zeros != nullptr ? zeros[g] : 0.0f)) * scales[g];
    dst[blockIdx.x * k + index[j]] = from_float<T>(w);
  }
}

}  // namespace kvserve::cuda
