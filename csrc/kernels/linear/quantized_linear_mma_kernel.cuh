#pragma once
// CUDA body of quantized_linear on tensor cores, for a few to a few hundred tokens (contract:
// quantized_linear.h; bf16 and fp16 inputs). The product is computed transposed,
// out^T [n, m] = dequant(W) [n, k] x^T [k, m], so that weight rows fill the 16-row side of
// mma.m16n8k16 and tokens its 8-column side: eight tokens already use the tensor cores whole,
// as Marlin (Frantar et al., 2024) arranges it for small batches.
//
// A block computes 16 weight rows for up to 8 * kTiles tokens; its 8 warps split the inputs
// (warp w takes blocks of inputs w, w + 8, ...) and add their partial sums in shared memory at the
// end. Within a warp, lane 4g + c reads one 16-byte vector of rows g and g + 8 (16 int8 / fp8 or
// 32 int4 inputs), dequantizes it in registers to the input dtype ((q - zero) * scale in fp32,
// rounded: the dequantizing path's weights exactly), and feeds it to kInputs / 4 k-steps. The
// order of a dot product's terms is free, so the k-steps take the inputs in the order that
// makes every lane's share of A and of B one contiguous vector: in k-step s, lane c's slots
// 2c, 2c + 1, 2c + 8, 2c + 9 (PTX's fragment layout) hold inputs 4s .. 4s + 3 of its vector, in
// A and in B alike, so the B fragments are the input row's own bytes, with no shuffling.
// Each lane copies the vectors it will use into its own shared-memory slots with cp.async,
// kMmaGemmStages - 1 blocks of inputs ahead, so a warp keeps kilobytes of weight in flight
// without holding registers for them (and, the slots being the lane's own, without barriers).
// Raw pointers only, no torch headers; the launcher checks shapes, dtypes and alignment
// (vector_gemv_applies).

#include <cstdint>
#include <cstring>

#include "kernels/cuda_mma.cuh"
#include "kernels/linear/quantized_linear_kernel.cuh"

namespace kvserve::cuda {

/// Weight rows a block computes: the mma's 16.
constexpr int kMmaGemmRows = 16;
/// Warps of a block, splitting its inputs.
constexpr int kMmaGemmWarps = 8;
constexpr int kMmaGemmThreads = 32 * kMmaGemmWarps;
/// Tiles of 8 tokens a block takes at most (more tokens: more blocks).
constexpr int kMmaGemmMaxTiles = 8;

/// Stages of a warp's pipeline: blocks of inputs in flight (cp.async into shared memory, which
/// holds no registers while the copy runs) while one is used.
constexpr int kMmaGemmStages = 4;

/// Token tiles (of 8) a launch for m tokens is compiled for: the fewest of 1, 2, 4, 8 that hold
/// them, 8 beyond 64 tokens.
inline int mma_gemm_tiles(int64_t m) {
  return m <= 8 ? 1 : m <= 16 ? 2 : m <= 32 ? 4 : kMmaGemmMaxTiles;
}

/// The grid for m tokens and n rows: one block per 16 rows and 8 * tiles tokens, the token tiles
/// of a row block adjacent (they read the same weights, from L2 after the first).
inline int64_t mma_gemm_blocks(int64_t m, int64_t n, int tiles) {
  const int64_t token_tiles = (m + 8 * tiles - 1) / (8 * tiles);
  return token_tiles * ((n + kMmaGemmRows - 1) / kMmaGemmRows);
}

/// Dynamic shared memory of a block: the stages, each 16 bytes of two rows for every lane
/// ([stages][warps][2][32] 16-byte vectors), which the warps' partial sums (fp32
/// [warps][16 rows][8 * tiles]) replace at the end.
inline size_t mma_gemm_shared_bytes(int tiles) {
  const size_t stages = 16 * kMmaGemmStages * kMmaGemmWarps * 2 * 32;
  const size_t partials = sizeof(float) * kMmaGemmWarps * kMmaGemmRows * 8 * tiles;
  return stages > partials ? stages : partials;
}

/// Row `row`'s vector `v` of q dequantized to T and packed as the A fragments of its k-steps:
/// a[s][h] holds inputs 4s, 4s + 1 and a[s][2 + h] inputs 4s + 2, 4s + 3 (h: 0 for row g, 1 for
/// row g + 8). `live`: the row and the vector exist (else zeros).
template <typename T, QuantFormat F, bool kZeros, int kSteps, typename P>
__device__ inline void dequantize_fragments(const uint4& packed, bool live, const P* scales,
                                            const P* zeros, int64_t g, int h,
                                            uint32_t (&a)[kSteps][4]) {
  constexpr int kInputs = kVectorInputs<F>;
  float w[kInputs];
  if (live) {
    unpack_vector<F>(packed, w);
    const float scale = to_float(scales[g]);
    const float zero = kZeros ? to_float(zeros[g]) : 0.0f;
#pragma unroll
    for (int j = 0; j < kInputs; ++j) w[j] = kZeros ? (w[j] - zero) * scale : w[j] * scale;
  } else {
#pragma unroll
    for (int j = 0; j < kInputs; ++j) w[j] = 0.0f;
  }
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    a[s][h] = pack_pair<T>(w[4 * s], w[4 * s + 1]);
    a[s][2 + h] = pack_pair<T>(w[4 * s + 2], w[4 * s + 3]);
  }
}

/// Grid mma_gemm_blocks(m, n, kTiles), block kMmaGemmThreads, mma_gemm_shared_bytes(kTiles) of
/// dynamic shared memory; where vector_gemv_applies. out [m, n] = input [m, k] (row stride
/// input_stride) @ dequant(q)^T + bias (nullable). kZeros: zeros is not null; scales and zeros
/// P (fp32 or fp16).
template <typename T, QuantFormat F, int kTiles, bool kZeros, typename P>
__global__ void __launch_bounds__(kMmaGemmThreads, 2)
    quantized_gemm_mma_kernel(const T* input, int64_t input_stride, int64_t m, const uint8_t* q,
                              const P* scales, const P* zeros, const T* bias, T* out,
                              int64_t n, int64_t k, int64_t group_size) {
  constexpr int kInputs = kVectorInputs<F>;  // of one lane's vector
  constexpr int kSteps = kInputs / 4;        // k-steps a vector feeds
  constexpr int kTokens = 8 * kTiles;
  const int64_t token_tiles = (m + kTokens - 1) / kTokens;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x / token_tiles) * kMmaGemmRows;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x % token_tiles) * kTokens;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4, c = lane % 4;
  const int64_t vectors = k / kInputs, groups = k / group_size;
  const int64_t blocks = (vectors + 3) / 4;  // of 4 vectors: a warp's k-steps at a time
  const int64_t row_bytes = quantized_row_bytes<F>(k);

  int64_t rows[2];
  bool row_live[2];
  const uint4* row_vectors[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    rows[h] = row0 + g + 8 * h;
    row_live[h] = rows[h] < n;
    row_vectors[h] = reinterpret_cast<const uint4*>(q + (row_live[h] ? rows[h] : 0) * row_bytes);
  }
  // Lane g's token in tile 0 (its B fragments' column); tile j's is 8j further.
  const T* tokens = input + (t0 + g) * input_stride;

  // This lane's stage slots: [stage][warp][row half h][lane] 16-byte vectors, its own alone.
  uint4* slots = static_cast<uint4*>(dynamic_shared_memory()) + (warp * 2) * 32 + lane;
  auto slot = [&](int i, int h) {
    return slots + ((i % kMmaGemmStages) * kMmaGemmWarps * 2 + h) * 32;
  };
  // The warp's blocks of inputs: warp, warp + kMmaGemmWarps, ...; the i-th into stage i.
  const int count =
      blocks > warp ? static_cast<int>((blocks - warp + kMmaGemmWarps - 1) / kMmaGemmWarps) : 0;
  auto issue = [&](int i) {
    if (i < count) {
      const int64_t v = 4 * (warp + static_cast<int64_t>(kMmaGemmWarps) * i) + c;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const bool fill = v < vectors && row_live[h];
        cp_async_16(slot(i, h), row_vectors[h] + (fill ? v : 0), fill);
      }
    }
    cp_async_commit();  // empty groups too, so that every wait counts the same
  };
#pragma unroll
  for (int i = 0; i < kMmaGemmStages - 1; ++i) issue(i);

  float acc[kTiles][4] = {};
  for (int i = 0; i < count; ++i) {
    cp_async_wait<kMmaGemmStages - 2>();  // block i has landed
    const uint4 packed[2] = {*slot(i, 0), *slot(i, 1)};
    issue(i + kMmaGemmStages - 1);  // into the stage block i - 1 left
    const int64_t v = 4 * (warp + static_cast<int64_t>(kMmaGemmWarps) * i) + c;
    const bool live = v < vectors;
    const int64_t group = live ? v * kInputs / group_size : 0;
    uint32_t a[kSteps][4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      dequantize_fragments<T, F, kZeros, kSteps>(packed[h], live && row_live[h], scales, zeros,
                                                 rows[h] * groups + group, h, a);
    }
#pragma unroll
    for (int j = 0; j < kTiles; ++j) {
      // The token's inputs v * kInputs .. + kInputs: 2 per register, in k-step order.
      uint32_t x[kInputs / 2];
      if (live && t0 + 8 * j + g < m) {
        const uint4* src =
            reinterpret_cast<const uint4*>(tokens + 8 * j * input_stride + v * kInputs);
#pragma unroll
        for (int e = 0; e < kInputs / 8; ++e) {
          const uint4 chunk = src[e];
          x[4 * e] = chunk.x;
          x[4 * e + 1] = chunk.y;
          x[4 * e + 2] = chunk.z;
          x[4 * e + 3] = chunk.w;
        }
      } else {
#pragma unroll
        for (int e = 0; e < kInputs / 2; ++e) x[e] = 0;
      }
#pragma unroll
      for (int step = 0; step < kSteps; ++step) {
        const uint32_t b[2] = {x[2 * step], x[2 * step + 1]};
        mma_m16n8k16<T>(acc[j], a[step], b);
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the partial sums below take the stages' place

  // The warps' sums: partial[warp][row][token], then one thread per output adds them up.
  float* partial = static_cast<float*>(dynamic_shared_memory());
#pragma unroll
  for (int j = 0; j < kTiles; ++j) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = g + 8 * (i / 2), token = 8 * j + 2 * c + i % 2;
      partial[(warp * kMmaGemmRows + row) * kTokens + token] = acc[j][i];
    }
  }
  __syncthreads();
  for (int e = static_cast<int>(threadIdx.x); e < kMmaGemmRows * kTokens; e += kMmaGemmThreads) {
    const int token = e / kMmaGemmRows, row = e % kMmaGemmRows;
    const int64_t t = t0 + token, o = row0 + row;
    if (t >= m || o >= n) continue;
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kMmaGemmWarps; ++w)
      sum += partial[(w * kMmaGemmRows + row) * kTokens + token];
    if (bias != nullptr) sum += to_float(bias[o]);
    out[t * n + o] = from_float<T>(sum);
  }
}

}  // namespace kvserve::cuda
