#pragma once
// CUDA bodies of quantized_linear (contract: quantized_linear.h): a GEMV with one warp per output
// row that reads the row once for all of a few tokens and dequantizes in registers, reducing
// with shuffles: by 16-byte vectors where the data is aligned for them (the usual case), else
// by 4-byte words, byte by byte where need be; and a dequantization of rows to the input dtype
// for the prefill GEMM (cuBLAS), again by vectors where it can. fused_moe_quantized's body
// reuses the row dot products.
// Raw pointers only, no torch headers; the launcher checks shapes and dtypes.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <cstring>

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
/// warp). q: [n, row bytes of k]; scales / zeros (nullable): P (fp32 or fp16) [n, k / group_size].
template <QuantFormat F, int kTokens, typename X, typename P>
__device__ inline void quantized_row_dot(const X* x, int64_t x_stride, int m, const uint8_t* q,
                                         const P* scales, const P* zeros, int64_t o,
                                         int64_t k, int64_t group_size, bool aligned, int lane,
                                         float* acc) {
  const int64_t groups = k / group_size, row_bytes = quantized_row_bytes<F>(k);
  const uint8_t* row = q + o * row_bytes;
  const P* s = scales + o * groups;
  const P* z = zeros != nullptr ? zeros + o * groups : nullptr;
  for (int64_t b = 4 * lane; b < row_bytes; b += 4 * 32) {
    float values[8];
    int64_t index[8];
    const int count = unpack_word<F>(row, b, row_bytes, aligned, values, index);
    for (int j = 0; j < count; ++j) {
      const int64_t g = index[j] / group_size;
      const float w = (values[j] - (z != nullptr ? to_float(z[g]) : 0.0f)) * to_float(s[g]);
#pragma unroll
      for (int t = 0; t < kTokens; ++t) {
        if (t < m) acc[t] += to_float(x[t * x_stride + index[j]]) * w;
      }
    }
  }
}

/// Tokens one GEMV launch takes at most (the launcher splits more into launches).
constexpr int kQuantizedGemvTokens = 8;
/// Threads of a GEMV block: a warp per output row.
constexpr int kQuantizedGemvThreads = 256;

/// The GEMV's grid for n output rows.
inline unsigned int blocks_for_rows(int64_t n) {
  constexpr int64_t kRows = kQuantizedGemvThreads / 32;
  return static_cast<unsigned int>((n + kRows - 1) / kRows);
}

/// Grid ceil(n / warps per block), block a multiple of 32 threads. out [m, n] = input [m, k]
/// (row stride input_stride), m <= kQuantizedGemvTokens, @ dequant(q)^T + bias (nullable): each
/// warp reads its weight row once for all m tokens. scales and zeros (nullable) P (fp32 or
/// fp16) [n, k / group_size]; `aligned`: q starts at a multiple of 4 and its rows are whole words.
template <typename T, QuantFormat F, typename P>
__global__ void quantized_gemv_kernel(const T* input, int64_t input_stride, int m,
                                      const uint8_t* q, const P* scales, const P* zeros,
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

/// Inputs in one 16-byte vector of a row: 16 int8 / fp8 values, or one 32-input int4 chunk.
template <QuantFormat F>
constexpr int kVectorInputs = F == QuantFormat::kInt4 ? 32 : 16;

/// The vector kernels apply to q's rows when every 16-byte load of them is aligned and holds
/// inputs of one group: qweight's start at a multiple of 16, whole vectors per row, group_size a
/// multiple of the vector's inputs.
template <QuantFormat F>
inline bool vector_rows_apply(const void* q, int64_t k, int64_t group_size) {
  return reinterpret_cast<uintptr_t>(q) % 16 == 0 && k % kVectorInputs<F> == 0 &&
         group_size % kVectorInputs<F> == 0;
}

/// The vector GEMV also reads the input rows 16 bytes at a time: their start and stride (in
/// bytes) must be multiples of 16.
template <QuantFormat F>
inline bool vector_gemv_applies(const void* q, const void* x, int64_t x_stride_bytes, int64_t k,
                                int64_t group_size) {
  return vector_rows_apply<F>(q, k, group_size) && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
         x_stride_bytes % 16 == 0;
}

/// The 4 bytes of `word` as fp32: int8 by the exponent trick (byte ^ 0x80 placed in the mantissa
/// of 2^23, minus 2^23 + 128: exact, two integer-unit instructions and a subtraction instead of
/// the slow int-to-float conversion); fp8 E4M3 through the paired fp8-to-fp16 conversion.
template <QuantFormat F>
__device__ inline void unpack_bytes(uint32_t word, float* w) {
  if constexpr (F == QuantFormat::kInt8) {
    const uint32_t biased = word ^ 0x80808080u;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      w[j] = __uint_as_float(__byte_perm(biased, 0x4b000000u, 0x7440u | j)) - 8388736.0f;
    }
  } else {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const __half2_raw pair = __nv_cvt_fp8x2_to_halfraw2(
          static_cast<__nv_fp8x2_storage_t>((word >> (16 * j)) & 0xffffu), __NV_E4M3);
      const float2 f = __half22float2(__half2(pair));
      w[2 * j] = f.x;
      w[2 * j + 1] = f.y;
    }
  }
}

/// The kVectorInputs<F> values of a 16-byte vector in input order, as fp32 before their group's
/// zero and scale. int4: byte j holds input j (low nibble) and j + 16 (high), each placed in the
/// mantissa of 2^23 and 2^23 subtracted.
template <QuantFormat F>
__device__ inline void unpack_vector(const uint4& packed, float* w) {
  const uint32_t words[4] = {packed.x, packed.y, packed.z, packed.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (F == QuantFormat::kInt4) {
      const uint32_t low = words[i] & 0x0f0f0f0fu, high = (words[i] >> 4) & 0x0f0f0f0fu;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        w[4 * i + j] = __uint_as_float(__byte_perm(low, 0x4b000000u, 0x7440u | j)) - 8388608.0f;
        w[16 + 4 * i + j] =
            __uint_as_float(__byte_perm(high, 0x4b000000u, 0x7440u | j)) - 8388608.0f;
      }
    } else {
      unpack_bytes<F>(words[i], w + 4 * i);
    }
  }
}

/// kCount consecutive inputs at x (16-byte aligned) as fp32, by 16-byte loads.
template <typename X, int kCount>
__device__ inline void load_inputs(const X* x, float* out) {
  constexpr int kPerLoad = 16 / static_cast<int>(sizeof(X));
  const uint4* src = reinterpret_cast<const uint4*>(x);
#pragma unroll
  for (int i = 0; i < kCount / kPerLoad; ++i) {
    const uint4 v = src[i];
    X e[kPerLoad];
    memcpy(e, &v, sizeof(v));  // registers; a pointer cast would break strict aliasing
#pragma unroll
    for (int j = 0; j < kPerLoad; ++j) out[i * kPerLoad + j] = to_float(e[j]);
  }
}

/// quantized_row_dot by 16-byte vectors, where vector_gemv_applies to q and x: lane l takes the
/// vectors l, l + 32, ... of row o (32 x 16 bytes a warp at a time), dequantizes each in
/// registers and takes its dot product with every token's inputs before the group's zero and
/// scale (w = (q - z) s, so x . w = s (x . q - z sum(x)); kZeros: zeros is not null).
template <QuantFormat F, int kTokens, bool kZeros, typename X, typename P>
__device__ inline void quantized_row_dot_vectors(const X* x, int64_t x_stride, int m,
                                                 const uint8_t* q, const P* scales,
                                                 const P* zeros, int64_t o, int64_t k,
                                                 int64_t group_size, int lane, float* acc) {
  constexpr int kInputs = kVectorInputs<F>;
  const int vectors = static_cast<int>(k / kInputs);
  const int vectors_per_group = static_cast<int>(group_size / kInputs);
  const int64_t groups = k / group_size;
  const uint4* row = reinterpret_cast<const uint4*>(q + o * quantized_row_bytes<F>(k));
  const P* s = scales + o * groups;
#pragma unroll 2
  for (int v = lane; v < vectors; v += 32) {
    float w[kInputs];
    unpack_vector<F>(row[v], w);
    const int g = v / vectors_per_group;
    const float scale = to_float(s[g]);
#pragma unroll
    for (int t = 0; t < kTokens; ++t) {
      if (t >= m) break;
      float in[kInputs];
      load_inputs<X, kInputs>(x + t * x_stride + static_cast<int64_t>(v) * kInputs, in);
      float dot = 0.0f;
#pragma unroll
      for (int j = 0; j < kInputs; ++j) dot += in[j] * w[j];
      if constexpr (kZeros) {
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < kInputs; ++j) sum += in[j];
        dot -= to_float(zeros[o * groups + g]) * sum;
      }
      acc[t] += scale * dot;
    }
  }
}

/// quantized_row_dot_vectors with a zeros pointer that may be null, and kTokens = 1: for
/// callers (fused_moe_quantized) whose zeros differ per expert.
template <QuantFormat F, typename X, typename P>
__device__ inline void quantized_row_dot_vectors(const X* x, const uint8_t* q,
                                                 const P* scales, const P* zeros,
                                                 int64_t o, int64_t k, int64_t group_size,
                                                 int lane, float* acc) {
  if (zeros != nullptr) {
    quantized_row_dot_vectors<F, 1, true>(x, 0, 1, q, scales, zeros, o, k, group_size, lane, acc);
  } else {
    quantized_row_dot_vectors<F, 1, false>(x, 0, 1, q, scales, zeros, o, k, group_size, lane,
                                           acc);
  }
}

/// Grid ceil(n / warps per block), block a multiple of 32 threads; where vector_gemv_applies.
/// out [m, n] = input [m, k] @ dequant(q)^T + bias for m <= kTokens: a warp per output row
/// (quantized_row_dot_vectors), reduced by shuffles.
template <typename T, QuantFormat F, int kTokens, bool kZeros, typename P>
__global__ void quantized_gemv_vector_kernel(const T* input, int64_t input_stride, int m,
                                             const uint8_t* q, const P* scales,
                                             const P* zeros, const T* bias, T* out,
                                             int64_t n, int64_t k, int64_t group_size) {
  const int lane = threadIdx.x % 32;
  const int64_t o = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (o >= n) return;  // whole warps leave together
  float acc[kTokens] = {};
  quantized_row_dot_vectors<F, kTokens, kZeros>(input, input_stride, m, q, scales, zeros, o, k,
                                                group_size, lane, acc);
#pragma unroll
  for (int t = 0; t < kTokens; ++t) {
    if (t >= m) break;
    const float total = warp_sum(acc[t]);
    if (lane == 0) {
      out[t * n + o] = from_float<T>(bias != nullptr ? total + to_float(bias[o]) : total);
    }
  }
}

/// Grid (rows, ceil(row_bytes / 4 / blockDim.x)). dst [rows, k] (T, contiguous, inputs in their
/// natural order) = dequant(q) rows [row_begin, row_begin + rows). `aligned` as for the GEMV.
template <typename T, QuantFormat F, typename P>
__global__ void quantized_dequantize_kernel(const uint8_t* q, const P* scales,
                                            const P* zeros, T* dst, int64_t row_begin,
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
    const float w =
        (values[j] - (zeros != nullptr ? to_float(zeros[g]) : 0.0f)) * to_float(scales[g]);
    dst[blockIdx.x * k + index[j]] = from_float<T>(w);
  }
}

/// Grid (rows, ceil(row vectors / blockDim.x)); where vector_rows_apply (dst's rows are then
/// 16-byte aligned too). dst [rows, k] (T,
/// contiguous) = dequant(q) rows [row_begin, row_begin + rows), a 16-byte vector of q a thread,
/// its outputs stored 16 bytes at a time.
template <typename T, QuantFormat F, typename P>
__global__ void quantized_dequantize_vector_kernel(const uint8_t* q, const P* scales,
                                                   const P* zeros, T* dst, int64_t row_begin,
                                                   int64_t k, int64_t group_size) {
  constexpr int kInputs = kVectorInputs<F>;
  constexpr int kPerStore = 16 / static_cast<int>(sizeof(T));
  const int64_t o = row_begin + blockIdx.x;
  const int64_t v = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (v >= k / kInputs) return;
  const int64_t g = o * (k / group_size) + v * kInputs / group_size;
  const float scale = to_float(scales[g]), zero = zeros != nullptr ? to_float(zeros[g]) : 0.0f;
  float w[kInputs];
  unpack_vector<F>(reinterpret_cast<const uint4*>(q + o * quantized_row_bytes<F>(k))[v], w);
  uint4* out = reinterpret_cast<uint4*>(dst + blockIdx.x * k + v * kInputs);
#pragma unroll
  for (int i = 0; i < kInputs / kPerStore; ++i) {
    T e[kPerStore];
#pragma unroll
    for (int j = 0; j < kPerStore; ++j) e[j] = from_float<T>((w[i * kPerStore + j] - zero) * scale);
    uint4 packed;
    memcpy(&packed, e, sizeof(packed));
    out[i] = packed;
  }
}

}  // namespace kvserve::cuda
