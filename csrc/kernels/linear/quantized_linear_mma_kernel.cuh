#pragma once
// CUDA body of quantized_linear on tensor cores, for a few to a few hundred tokens (contract:
// quantized_linear.h; bf16 and fp16 inputs). The product is computed transposed,
// out^T [n, m] = dequant(W) [n, k] x^T [k, m], so that weight rows fill the 16-row side of
// mma.m16n8k16 and tokens its 8-column side: eight tokens already use the tensor cores whole,
// as Marlin (Frantar et al., 2024) arranges it for small batches.
//
// A block computes 8 * 16 weight rows, a warp's 16 each, for up to 8 * kTiles tokens, over one
// split of the inputs: all its warps read the same inputs at about the same time, so each
// token's row comes from L2 once a block and from L1 for the other warps (with 16 rows a block
// the inputs read from L2 would outweigh the weight from 16 tokens on). Where the rows alone
// make too few blocks to fill the GPU, the inputs are split across blocks (mma_gemm_plan), each
// split's fp32 sums written apart and added up by quantized_gemm_reduce_kernel. Within a warp,
// lane 4g + c reads one 16-byte vector of rows g and g + 8 (16 int8 / fp8 or 32 int4 inputs),
// dequantizes it in registers to the input dtype ((q - zero) * scale in fp32, rounded: the
// dequantizing path's weights exactly), and feeds it to kInputs / 4 k-steps. The order of a
// dot product's terms is free, so the k-steps take the inputs in the order that makes every
// lane's share of A and of B one contiguous vector: in k-step s, lane c's slots 2c, 2c + 1,
// 2c + 8, 2c + 9 (PTX's fragment layout) hold inputs 4s .. 4s + 3 of its vector, in A and in B
// alike, so the B fragments are the input row's own bytes, with no shuffling.
// Each lane copies the vectors it will use into its own shared-memory slots with cp.async,
// kMmaGemmStages - 1 blocks of inputs ahead, so a warp keeps kilobytes of weight in flight
// without holding registers for them (and, the slots being the lane's own, without barriers).
// Raw pointers only, no torch headers; the launcher checks shapes, dtypes and alignment
// (vector_gemv_applies).

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/cuda_mma.cuh"
#include "kernels/linear/quantized_linear_kernel.cuh"

namespace kvserve::cuda {

/// Weight rows a warp computes: the mma's 16.
constexpr int kMmaGemmRows = 16;
/// Warps of a block, each on its own rows.
constexpr int kMmaGemmWarps = 8;
constexpr int kMmaGemmThreads = 32 * kMmaGemmWarps;
constexpr int kMmaGemmBlockRows = kMmaGemmRows * kMmaGemmWarps;
/// Tiles of 8 tokens a block takes at most (more tokens: more blocks).
constexpr int kMmaGemmMaxTiles = 8;

/// Stages of a warp's pipeline: blocks of inputs in flight (cp.async into shared memory, which
/// holds no registers while the copy runs) while one is used.
constexpr int kMmaGemmStages = 4;
/// Blocks a launch aims at per multiprocessor (two fit: 128 registers a thread), so that the
/// weight streams from every multiprocessor with as many bytes in flight as it holds.
constexpr int kMmaGemmBlocksPerSm = 2;
/// Blocks of inputs a split keeps at least, so that its pipeline fills.
constexpr int kMmaGemmMinSplitBlocks = 8;

/// Tiles of 8 tokens the int4 kernel with block sums takes at most: with 8 its registers spill.
constexpr int kMmaGemmBlockSumsMaxTiles = 4;

/// Token tiles (of 8) a launch for m tokens is compiled for: the fewest of 1, 2, 4, 8 that hold
/// them, at most `most` (a power of two up to kMmaGemmMaxTiles).
inline int mma_gemm_tiles(int64_t m, int most = kMmaGemmMaxTiles) {
  const int tiles = m <= 8 ? 1 : m <= 16 ? 2 : m <= 32 ? 4 : kMmaGemmMaxTiles;
  return tiles < most ? tiles : most;
}

/// The grid of a launch: (row blocks * token tiles, splits), the token tiles of a row block
/// adjacent (they read the same weights, from L2 after the first); each split takes
/// split_blocks blocks of 4 vectors of the inputs (the last one what is left).
struct MmaGemmPlan {
  int64_t row_blocks, token_tiles, splits, split_blocks;
  int64_t blocks() const { return row_blocks * token_tiles * splits; }
};

/// The plan for m tokens, n rows and k inputs (vectors of kVectorInputs<F>) on `sms`
/// multiprocessors: splits of the inputs until the blocks fill the GPU, as long as each split
/// keeps kMmaGemmMinSplitBlocks blocks of inputs.
template <QuantFormat F>
inline MmaGemmPlan mma_gemm_plan(int64_t m, int64_t n, int64_t k, int tiles, int sms) {
  MmaGemmPlan plan{};
  plan.row_blocks = (n + kMmaGemmBlockRows - 1) / kMmaGemmBlockRows;
  plan.token_tiles = (m + 8 * tiles - 1) / (8 * tiles);
  const int64_t input_blocks = (k / kVectorInputs<F> + 3) / 4;
  const int64_t rows_and_tokens = plan.row_blocks * plan.token_tiles;
  const int64_t wanted =
      (int64_t{kMmaGemmBlocksPerSm} * sms + rows_and_tokens - 1) / rows_and_tokens;
  const int64_t most = input_blocks / kMmaGemmMinSplitBlocks;
  const int64_t splits = wanted < most ? wanted : most;
  plan.split_blocks = splits > 1 ? (input_blocks + splits - 1) / splits : input_blocks;
  plan.splits =
      plan.split_blocks > 0 ? (input_blocks + plan.split_blocks - 1) / plan.split_blocks : 1;
  if (plan.splits < 1) plan.splits = 1;
  return plan;
}

/// Dynamic shared memory of a block: the stages, each 16 bytes of two rows for every lane
/// ([stages][warps][2][32] 16-byte vectors).
constexpr size_t kMmaGemmSharedBytes = 16 * kMmaGemmStages * kMmaGemmWarps * 2 * 32;

/// Row `row`'s vector `v` of q dequantized to T and packed as the A fragments of its k-steps:
/// a[s][h] holds inputs 4s, 4s + 1 and a[s][2 + h] inputs 4s + 2, 4s + 3 (h: 0 for row g, 1 for
/// row g + 8). `live`: the row and the vector exist (else zeros).
template <typename T, QuantFormat F, bool kZeros, int kSteps>
__device__ inline void dequantize_fragments(const uint4& packed, bool live, const float* scales,
                                            const float* zeros, int64_t g, int h,
                                            uint32_t (&a)[kSteps][4]) {
  constexpr int kInputs = kVectorInputs<F>;
  float w[kInputs];
  if (live) {
    unpack_vector<F>(packed, w);
    const float scale = scales[g];
    const float zero = kZeros ? zeros[g] : 0.0f;
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

/// The 16-bit pattern whose low 4 mantissa bits an int4 value fills to make offset + q exactly
/// in T (bf16: 128 + q, fp16: 1024 + q), and that offset.
template <typename T>
constexpr uint32_t kInt4Magic = std::is_same_v<T, __half> ? 0x64006400u : 0x43004300u;
template <typename T>
constexpr float kInt4Offset = std::is_same_v<T, __half> ? 1024.0f : 128.0f;

/// A row's int4 vector (32 inputs; byte j: input j low, j + 16 high) as the A fragments of its 8
/// k-steps, each entry offset + q exactly in T, two bit operations a pair: a[s][h] holds inputs
/// 4s, 4s + 1 and a[s][2 + h] inputs 4s + 2, 4s + 3. `live`: else zeros.
template <typename T>
__device__ inline void int4_fragments(const uint4& packed, bool live, int h, uint32_t (&a)[8][4]) {
  const uint32_t words[4] = {packed.x, packed.y, packed.z, packed.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    // Bytes 0, 1 (then 2, 3) of the word in the two 16-bit halves.
    const uint32_t low_pair = __byte_perm(words[i], 0u, 0x4140u);
    const uint32_t high_pair = __byte_perm(words[i], 0u, 0x4342u);
    // Inputs 4i .. 4i + 3 are the low nibbles (k-step i), 16 + 4i .. the high ones (step 4 + i).
    a[i][h] = live ? (low_pair & 0x000f000fu) | kInt4Magic<T> : 0u;
    a[i][2 + h] = live ? (high_pair & 0x000f000fu) | kInt4Magic<T> : 0u;
    a[4 + i][h] = live ? ((low_pair >> 4) & 0x000f000fu) | kInt4Magic<T> : 0u;
    a[4 + i][2 + h] = live ? ((high_pair >> 4) & 0x000f000fu) | kInt4Magic<T> : 0u;
  }
}

/// Whether the int4 fragments apply: every block of 4 vectors (128 inputs) inside one group, so
/// that a block's sums take one scale and zero per row.
template <QuantFormat F>
inline bool mma_block_sums_apply(int64_t group_size) {
  return F == QuantFormat::kInt4 && group_size % (4 * kVectorInputs<F>) == 0;
}

/// Inputs in a block of 4 int4 vectors: what one k-block of a warp covers.
constexpr int kInt4BlockInputs = 4 * kVectorInputs<QuantFormat::kInt4>;

/// Grid m, block a multiple of 32 threads: sums [m, ceil(k / kInt4BlockInputs)] (fp32) = each
/// token's sum of its inputs over each block of kInt4BlockInputs, a warp per block.
template <typename T>
__global__ void quantized_block_sums_kernel(const T* input, int64_t input_stride, int64_t k,
                                            float* sums) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t blocks = (k + kInt4BlockInputs - 1) / kInt4BlockInputs, t = blockIdx.x;
  const T* row = input + t * input_stride;
  for (int64_t b = threadIdx.x / 32; b < blocks; b += blockDim.x / 32) {
    float sum = 0.0f;
    for (int64_t i = b * kInt4BlockInputs + lane; i < k && i < (b + 1) * kInt4BlockInputs;
         i += 32) {
      sum += to_float(row[i]);
    }
    sum = warp_sum(sum);
    if (lane == 0) sums[t * blocks + b] = sum;
  }
}

/// Grid (plan.row_blocks * plan.token_tiles, plan.splits), block kMmaGemmThreads,
/// kMmaGemmSharedBytes of dynamic shared memory; where vector_gemv_applies. With one split:
/// out [m, n] = input [m, k] (row stride input_stride) @ dequant(q)^T + bias (nullable); with
/// more, partials [splits, m, n] (fp32) = each split's share, bias and out unused (see
/// quantized_gemm_reduce_kernel). kZeros: zeros is not null. kBlockSums (int4 where
/// mma_block_sums_apply): A holds offset + q, each block of inputs sums into its own
/// accumulators, and those fold into the result as s (sums - (zero + offset) * block_sums[t]),
/// with block_sums [m, k / kInt4BlockInputs] from quantized_block_sums_kernel: the weights
/// exactly, for a few bit operations a pair instead of a conversion, subtraction, product and
/// rounding each (Marlin's trick for building the values; the zero and scale move after the
/// sums).
template <typename T, QuantFormat F, int kTiles, bool kZeros, bool kBlockSums = false>
__global__ void __launch_bounds__(kMmaGemmThreads, kMmaGemmBlocksPerSm)
    quantized_gemm_mma_kernel(const T* input, int64_t input_stride, int64_t m, const uint8_t* q,
                              const float* scales, const float* zeros, const T* bias, T* out,
                              float* partials, int64_t n, int64_t k, int64_t group_size,
                              int64_t split_blocks, const float* block_sums) {
  static_assert(!kBlockSums || F == QuantFormat::kInt4, "block sums are int4's");
  constexpr int kInputs = kVectorInputs<F>;  // of one lane's vector
  constexpr int kSteps = kInputs / 4;        // k-steps a vector feeds
  constexpr int kTokens = 8 * kTiles;
  const int64_t token_tiles = (m + kTokens - 1) / kTokens;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t row0 =
      static_cast<int64_t>(blockIdx.x / token_tiles) * kMmaGemmBlockRows + warp * kMmaGemmRows;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x % token_tiles) * kTokens;
  const int g = lane / 4, c = lane % 4;
  const int64_t vectors = k / kInputs, groups = k / group_size;
  const int64_t input_blocks = (vectors + 3) / 4;  // of 4 vectors: a warp's k-steps at a time
  const int64_t first = static_cast<int64_t>(blockIdx.y) * split_blocks;
  const int count = static_cast<int>(
      first < input_blocks
          ? (input_blocks - first < split_blocks ? input_blocks - first : split_blocks)
          : 0);
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
  // The i-th block of inputs of the split goes into stage i % kMmaGemmStages.
  auto issue = [&](int i) {
    if (i < count) {
      const int64_t v = 4 * (first + i) + c;
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
    const int64_t v = 4 * (first + i) + c;
    const bool live = v < vectors;
    const int64_t group = live ? v * kInputs / group_size : 0;
    uint32_t a[kSteps][4];
    float scale[2], shift[2];  // kBlockSums: each row's scale, and zero + offset
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if constexpr (kBlockSums) {
        int4_fragments<T>(packed[h], live && row_live[h], h, a);
        // The block's group: the same for all its lanes (mma_block_sums_apply).
        const int64_t index = rows[h] * groups + 4 * (first + i) * kInputs / group_size;
        scale[h] = row_live[h] ? scales[index] : 0.0f;
        shift[h] = (kZeros && row_live[h] ? zeros[index] : 0.0f) + kInt4Offset<T>;
      } else {
        dequantize_fragments<T, F, kZeros, kSteps>(packed[h], live && row_live[h], scales, zeros,
                                                   rows[h] * groups + group, h, a);
      }
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
      if constexpr (kBlockSums) {
        float sums[4] = {};
#pragma unroll
        for (int step = 0; step < kSteps; ++step) {
          const uint32_t b[2] = {x[2 * step], x[2 * step + 1]};
          mma_m16n8k16<T>(sums, a[step], b);
        }
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int64_t t = t0 + 8 * j + 2 * c + e;
          const float inputs = t < m ? block_sums[t * input_blocks + first + i] : 0.0f;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            acc[j][2 * h + e] += scale[h] * (sums[2 * h + e] - shift[h] * inputs);
          }
        }
      } else {
#pragma unroll
        for (int step = 0; step < kSteps; ++step) {
          const uint32_t b[2] = {x[2 * step], x[2 * step + 1]};
          mma_m16n8k16<T>(acc[j], a[step], b);
        }
      }
    }
  }
  cp_async_wait<0>();

  // acc[j][i]: row g + 8 (i / 2), token 8j + 2c + i % 2.
#pragma unroll
  for (int j = 0; j < kTiles; ++j) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t t = t0 + 8 * j + 2 * c + i % 2, o = rows[i / 2];
      if (t >= m || o >= n) continue;
      if (partials != nullptr) {
        partials[(blockIdx.y * m + t) * n + o] = acc[j][i];
      } else {
        out[t * n + o] = from_float<T>(bias != nullptr ? acc[j][i] + to_float(bias[o]) : acc[j][i]);
      }
    }
  }
}

/// Grid ceil(m * n / blockDim.x): out [m, n] = the sum of partials [splits, m, n] + bias
/// (nullable), in T.
template <typename T>
__global__ void quantized_gemm_reduce_kernel(const float* partials, int64_t splits, int64_t m,
                                             int64_t n, const T* bias, T* out) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= m * n) return;
  float sum = bias != nullptr ? to_float(bias[e % n]) : 0.0f;
  for (int64_t s = 0; s < splits; ++s) sum += partials[s * m * n + e];
  out[e] = from_float<T>(sum);
}

}  // namespace kvserve::cuda
