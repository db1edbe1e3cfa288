#pragma once
// CUDA body of quantized_linear on tensor cores in wide blocks of rows, for batches of 8 to a few
// hundred tokens (contract: quantized_linear.h; bf16 and fp16 inputs). It keeps the fragment
// scheme of quantized_linear_mma_kernel.cuh (weight rows on the 16-row side of mma.m16n8k16,
// tokens on its 8-column side, lane 4g + c dequantizing one 16-byte vector of rows g and g + 8
// into the A fragments of kInputs / 4 k-steps) and changes where the inputs come from, which is
// what held the narrow kernel back: there every block of 16 rows read all of the tokens' inputs
// again, 8 bytes from L2 for each byte of int8 weight at 64 tokens. Here, as in Marlin (Frantar
// et al., 2024):
// - a block computes 128 rows (one 16-row tile a warp) for up to 16 tokens, or 256 rows (two
//   tiles a warp, so every B fragment read from shared memory feeds two mma) for up to 64;
// - the tokens' inputs of each k-block (a lane group's 4 vectors: 64 int8 / fp8 or 128 int4
//   inputs) are staged in shared memory once for the block by cp.async, beside each warp's weight
//   vectors, kWideGemmStages k-blocks in flight;
// - the inputs are staged step-major ([token][k-step][lane c][4 inputs], 8 bytes each), so that in
//   k-step s lane (g, c) reads its B fragment as one 8-byte word, and a token's row is padded by
//   32 bytes so that the 16 lanes of a half-warp (4 tokens x 4 lanes) hit 32 different banks;
// - to fill the GPU when the rows alone make too few blocks, the k-blocks are split among
//   `splits` blocks per tile: each writes its fp32 sums to `partials`, and the last to arrive
//   (a counter per tile, zero before the launch and again after it) adds the splits in order
//   (so the result does not depend on which block finished first), adds the bias and writes out.
// Raw pointers only, no torch headers; the launcher checks shapes, dtypes and alignment
// (vector_gemv_applies) and picks the split.

#include <cstdint>

#include "kernels/cuda_mma.cuh"
#include "kernels/linear/quantized_linear_kernel.cuh"
#include "kernels/linear/quantized_linear_mma_kernel.cuh"

namespace kvserve::cuda {

/// Warps of a block, each computing its own rows over the block's k-blocks.
constexpr int kWideGemmWarps = 8;
constexpr int kWideGemmThreads = 32 * kWideGemmWarps;
/// Tiles of 8 tokens a block takes at most (more tokens: more blocks).
constexpr int kWideGemmMaxTiles = 8;
/// k-blocks in flight: staged by cp.async while one is used.
constexpr int kWideGemmStages = 4;
/// A split takes at least this many k-blocks, so that its pipeline fills.
constexpr int kWideGemmMinSplitBlocks = 2 * kWideGemmStages;

/// 16-row tiles a warp computes for `tiles` token tiles: two from 32 tokens, where the inputs'
/// reads from shared memory would otherwise outweigh the weights' from memory.
__host__ __device__ constexpr int wide_gemm_row_tiles(int tiles) { return tiles >= 4 ? 2 : 1; }

/// Rows of a block.
__host__ __device__ constexpr int wide_gemm_rows(int tiles) {
  return 16 * kWideGemmWarps * wide_gemm_row_tiles(tiles);
}

/// Bytes of one token's inputs of a k-block in shared memory: 4 vectors of 16-bit inputs and 32
/// bytes of padding.
template <QuantFormat F>
__host__ __device__ constexpr int wide_gemm_token_bytes() {
  return 2 * 4 * kVectorInputs<F> + 32;
}

/// Bytes of one stage: the tokens' inputs, then every warp's weight vectors ([warp][row tile]
/// [row half][lane] 16-byte vectors).
template <QuantFormat F>
__host__ __device__ constexpr size_t wide_gemm_stage_bytes(int tiles) {
  return static_cast<size_t>(8 * tiles) * wide_gemm_token_bytes<F>() +
         static_cast<size_t>(kWideGemmWarps) * wide_gemm_row_tiles(tiles) * 2 * 32 * 16;
}

/// Dynamic shared memory of a block.
template <QuantFormat F>
constexpr size_t wide_gemm_shared_bytes(int tiles) {
  return kWideGemmStages * wide_gemm_stage_bytes<F>(tiles);
}

/// Tiles of the grid (a block of rows by a block of tokens), each taken by `splits` blocks.
inline int64_t wide_gemm_tiles(int64_t m, int64_t n, int tiles) {
  const int64_t rows = wide_gemm_rows(tiles), tokens = 8 * tiles;
  return ((n + rows - 1) / rows) * ((m + tokens - 1) / tokens);
}

/// k-blocks of a row of k inputs.
template <QuantFormat F>
inline int64_t wide_gemm_k_blocks(int64_t k) {
  const int64_t inputs = 4 * kVectorInputs<F>;
  return (k + inputs - 1) / inputs;
}

/// The split for a grid of `tiles_count` tiles over k_blocks k-blocks on a GPU that holds
/// `resident` blocks at once: as many as make one full wave, each split at least
/// kWideGemmMinSplitBlocks k-blocks long; 1 when the tiles alone fill the GPU.
inline int wide_gemm_splits(int64_t tiles_count, int64_t k_blocks, int64_t resident) {
  int64_t splits = resident / (tiles_count > 0 ? tiles_count : 1);
  const int64_t longest = k_blocks / kWideGemmMinSplitBlocks;
  if (splits > longest) splits = longest;
  return splits < 1 ? 1 : static_cast<int>(splits);
}

/// A float another block wrote, read from L2 (not a stale L1 line).
__device__ inline float load_from_l2(const float* p) {
#if defined(__CUDA_ARCH__)
  return __ldcg(p);
#else
  return *p;
#endif
}

/// Grid wide_gemm_tiles(m, n, kTiles) * splits, block kWideGemmThreads,
/// wide_gemm_shared_bytes<F>(kTiles) of dynamic shared memory; where vector_gemv_applies.
/// out [m, n] = input [m, k] (row stride input_stride) @ dequant(q)^T + bias (nullable).
/// kZeros: zeros is not null; scales and zeros P (fp32 or fp16). splits > 1: partials holds
/// fp32 [splits, m, n] and counters int [wide_gemm_tiles(...)], zero at the launch (and left
/// zero); splits == 1: both may be null.
template <typename T, QuantFormat F, int kTiles, bool kZeros, typename P>
__global__ void __launch_bounds__(kWideGemmThreads, kTiles >= 4 ? 1 : 2)
    quantized_gemm_wide_kernel(const T* input, int64_t input_stride, int64_t m, const uint8_t* q,
                               const P* scales, const P* zeros, const T* bias, T* out, int64_t n,
                               int64_t k, int64_t group_size, int splits, float* partials,
                               int* counters) {
  constexpr int kInputs = kVectorInputs<F>;  // of one lane's vector
  constexpr int kSteps = kInputs / 4;        // k-steps a vector feeds
  constexpr int kBlockInputs = 4 * kInputs;  // of a k-block
  constexpr int kPieces = kBlockInputs / 4;  // 8-byte pieces of a token's k-block
  constexpr int kTokens = 8 * kTiles;
  constexpr int kRowTiles = wide_gemm_row_tiles(kTiles);
  constexpr int kRows = wide_gemm_rows(kTiles);
  constexpr int kTokenBytes = wide_gemm_token_bytes<F>();
  constexpr size_t kInputBytes = static_cast<size_t>(kTokens) * kTokenBytes;
  constexpr size_t kStageBytes = wide_gemm_stage_bytes<F>(kTiles);

  // The block's tile and split: splits of a tile adjacent, then the tiles of a row block (they
  // read the same weights, from L2 after the first).
  const int64_t token_blocks = (m + kTokens - 1) / kTokens;
  const int64_t tile = static_cast<int64_t>(blockIdx.x) / splits;
  const int split = static_cast<int>(blockIdx.x % splits);
  const int64_t row0 = (tile / token_blocks) * kRows, t0 = (tile % token_blocks) * kTokens;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4, c = lane % 4;
  const int64_t vectors = k / kInputs, groups = k / group_size;
  const int64_t k_blocks = (vectors + 3) / 4;
  const int64_t first = k_blocks * split / splits;
  const int count = static_cast<int>(k_blocks * (split + 1) / splits - first);
  const int64_t row_bytes = quantized_row_bytes<F>(k);

  int64_t rows[kRowTiles][2];
  bool row_live[kRowTiles][2];
  const uint4* row_vectors[kRowTiles][2];
#pragma unroll
  for (int r = 0; r < kRowTiles; ++r) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      rows[r][h] = row0 + (warp * kRowTiles + r) * 16 + g + 8 * h;
      row_live[r][h] = rows[r][h] < n;
      row_vectors[r][h] =
          reinterpret_cast<const uint4*>(q + (row_live[r][h] ? rows[r][h] : 0) * row_bytes);
    }
  }

  unsigned char* shared = static_cast<unsigned char*>(dynamic_shared_memory());
  auto stage = [&](int i) { return shared + (i % kWideGemmStages) * kStageBytes; };
  // This lane's weight vector of row tile r, half h, in stage i: its own slot.
  auto slot = [&](int i, int r, int h) {
    uint4* slots = reinterpret_cast<uint4*>(stage(i) + kInputBytes);
    return slots + ((warp * kRowTiles + r) * 2 + h) * 32 + lane;
  };
  // k-block first + i into stage i: this lane's weight vectors, and the block's threads share
  // the tokens' inputs, 8 bytes each, consecutive threads on consecutive global bytes.
  auto issue = [&](int i) {
    if (i < count) {
      const int64_t kb = first + i;
      const int64_t v = 4 * kb + c;
#pragma unroll
      for (int r = 0; r < kRowTiles; ++r) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const bool fill = v < vectors && row_live[r][h];
          cp_async_16(slot(i, r, h), row_vectors[r][h] + (fill ? v : 0), fill);
        }
      }
      for (int e = static_cast<int>(threadIdx.x); e < kTokens * kPieces; e += kWideGemmThreads) {
        const int token = e / kPieces, piece = e % kPieces;
        // Piece p holds inputs 4p .. 4p + 3 of the k-block: k-step p % kSteps of vector p / kSteps.
        const int vector = piece / kSteps, step = piece % kSteps;
        const int64_t at = kb * kBlockInputs + 4 * piece;
        const bool fill = t0 + token < m && at < k;
        const T* src = fill ? input + (t0 + token) * input_stride + at : input;
        cp_async_8(stage(i) + token * kTokenBytes + (step * 4 + vector) * 8, src, fill);
      }
    }
    cp_async_commit();  // empty groups too, so that every wait counts the same
  };
#pragma unroll
  for (int i = 0; i < kWideGemmStages - 1; ++i) issue(i);

  float acc[kRowTiles][kTiles][4] = {};
  for (int i = 0; i < count; ++i) {
    cp_async_wait<kWideGemmStages - 2>();  // this thread's copies of k-block i have landed
    __syncthreads();  // everyone's have; and k-block i - 1's stage is no longer read
    issue(i + kWideGemmStages - 1);
    const int64_t v = 4 * (first + i) + c;
    const bool live = v < vectors;
    const int64_t group = live ? v * kInputs / group_size : 0;
    uint32_t a[kRowTiles][kSteps][4];
#pragma unroll
    for (int r = 0; r < kRowTiles; ++r) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        dequantize_fragments<T, F, kZeros, kSteps>(*slot(i, r, h), live && row_live[r][h],
                                                   scales, zeros, rows[r][h] * groups + group, h,
                                                   a[r]);
      }
    }
    // Lane (g, c)'s B fragment of k-step s in token tile j: token 8j + g's piece (s, c).
    const unsigned char* inputs = stage(i) + g * kTokenBytes + c * 8;
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
#pragma unroll
      for (int j = 0; j < kTiles; ++j) {
        const uint2 pair =
            *reinterpret_cast<const uint2*>(inputs + j * 8 * kTokenBytes + s * 32);
        const uint32_t b[2] = {pair.x, pair.y};
#pragma unroll
        for (int r = 0; r < kRowTiles; ++r) mma_m16n8k16<T>(acc[r][j], a[r][s], b);
      }
    }
  }
  cp_async_wait<0>();

  // acc[r][j][e]: row tile r's row g + 8 (e / 2), token 8j + 2c + e % 2.
  auto each_output = [&](auto&& f) {
#pragma unroll
    for (int r = 0; r < kRowTiles; ++r) {
#pragma unroll
      for (int j = 0; j < kTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int64_t o = rows[r][e / 2], t = t0 + 8 * j + 2 * c + e % 2;
          if (o < n && t < m) f(o, t, acc[r][j][e]);
        }
      }
    }
  };
  if (splits == 1) {
    each_output([&](int64_t o, int64_t t, float sum) {
      out[t * n + o] = from_float<T>(bias != nullptr ? sum + to_float(bias[o]) : sum);
    });
    return;
  }
  each_output([&](int64_t o, int64_t t, float sum) { partials[(split * m + t) * n + o] = sum; });
  __threadfence();  // the sums reach L2 before the counter says so
  __syncthreads();
  __shared__ int last;
  if (threadIdx.x == 0) last = atomicAdd(&counters[tile], 1) == splits - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();  // the other splits' sums, seen after their counts
  for (int e = static_cast<int>(threadIdx.x); e < kRows * kTokens; e += kWideGemmThreads) {
    const int64_t o = row0 + e % kRows, t = t0 + e / kRows;  // consecutive threads: rows
    if (o >= n || t >= m) continue;
    float sum = 0.0f;
    for (int s = 0; s < splits; ++s) sum += load_from_l2(&partials[(s * m + t) * n + o]);
    out[t * n + o] = from_float<T>(bias != nullptr ? sum + to_float(bias[o]) : sum);
  }
  if (threadIdx.x == 0) counters[tile] = 0;  // for the next launch on the same counters
}

}  // namespace kvserve::cuda
