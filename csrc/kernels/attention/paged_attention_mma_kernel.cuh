#pragma once
// CUDA body of paged_attention on tensor cores (sm_80+), for bf16 / fp16 queries over caches of
// the query's dtype, int8 or fp8, with keys and values of one size, 64, 128 or 256 (contract:
// paged_attention.h). A thread block takes a tile of 16 * WM query rows of one sequence and one
// KV head, a row being a query token and one of the query heads that share the KV head: the GQA
// group is the matrix's M, so a decode step's group of heads reads each key and value row once
// and multiplies it on tensor cores (FlashInfer's decode layout), and a prefill's tokens x heads
// form flash-attention tiles. The block walks its context split N positions at a time: cp.async
// copies the next tile's key and value rows (gathered through the block table) into shared
// memory while the warps compute on this one (two stages); rows are stored XOR-swizzled in
// 16-byte chunks so ldmatrix reads them without bank conflicts. Quantized rows are copied raw
// with their scales and dequantized into the 16-bit tiles in shared memory when their stage
// comes up. The 4 warps are WM (rows) x WN (positions): each computes S = Q K^T for its 16 * MT
// rows and N / WN positions with mma.m16n8k16 (each key and value fragment read from shared
// memory feeds MT row tiles: FlashAttention-2's 128-row tiles are MT = 2), masks (causal,
// sliding window, outside the pool) unless every position of its stage is visible to all its
// rows, soft-caps, keeps a base-2 online softmax per row in registers, and accumulates P V with
// P taken straight from S's accumulators. The WN streams of a row merge in shared memory
// (store_merged_rows), as do splits in paged_attention_merge_kernel.

#include <cfloat>
#include <cstdint>

#include "kernels/attention/paged_attention_kernel.cuh"
#include "kernels/cuda_mma.cuh"

namespace kvserve::cuda {

/// The shape of one instantiation: HEAD_DIM 64, 128 or 256; WM x WN warps (4 in all); N
/// positions a stage, N / WN (8 or a multiple of 16) per warp; QUANTIZED: int8 / fp8 cache
/// entries; LATENT_VALUE_DIM > 0: MLA's latent cache, one for keys and values, a value being the
/// first LATENT_VALUE_DIM entries of its key row (HEAD_DIM any multiple of 64; WM = 1); MT
/// 16-row tiles of queries per warp (1 or 2; 1 over a latent).
template <int HEAD_DIM, int WM, int WN, int N, bool QUANTIZED = false, int LATENT_VALUE_DIM = 0,
          int MT = 1>
struct MmaAttentionShape {
  static constexpr bool kLatent = LATENT_VALUE_DIM > 0;
  static_assert(WM * WN == kAttentionWarps, "the block's 4 warps are WM x WN");
  static_assert(kLatent ? HEAD_DIM % 64 == 0 && WM == 1 &&
                              LATENT_VALUE_DIM % (16 * kAttentionWarps) == 0 &&
                              LATENT_VALUE_DIM <= HEAD_DIM
                        : HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == 256,
                "head sizes 64 to 256, or a latent of a multiple of 64");
  static_assert(N % (16 * WN) == 0 || (kLatent && N == 8 * WN),
                "each warp takes a multiple of 16 positions (8 over a latent)");
  static_assert(MT == 1 || (MT == 2 && !kLatent), "one or two row tiles a warp");
  static constexpr int kRows = 16 * WM * MT;       // query rows of a block
  static constexpr int kChunks = HEAD_DIM / 8;     // 16-byte chunks of a 16-bit row
  static constexpr int kWarpPositions = N / WN;    // positions per warp and stage
  static constexpr int kStages = 2;
  static constexpr int kValueDim = kLatent ? LATENT_VALUE_DIM : HEAD_DIM;
  // Output entries of a row per warp: all of them, or over a latent a quarter (the warps split
  // the value entries and share the probabilities).
  static constexpr int kOutputDim = kLatent ? kValueDim / kAttentionWarps : HEAD_DIM;
  // Shared memory, after Q [kRows][HEAD_DIM] of 16-bit entries: the key / value region, then
  // [kStages][N] flags of the rows that hold a position and key and value scales, then (latent)
  // the stage's scores [kRows][N]. Plain caches: K and V [kStages][N][HEAD_DIM] in the region,
  // copied as they are. Quantized: K and V [N][HEAD_DIM] of 16-bit entries (dequantized from
  // this stage), then raw K and V [kStages][N][HEAD_DIM] bytes. A latent has no V of its own.
  // The epilogue reuses Q and the region for the streams' maxima, sums and values per row.
  // A warp's queries are held in registers for the whole walk when they are 16 rows of up to 128
  // entries; others (two row tiles, whose scores and outputs fill the registers) are read from
  // shared memory at each use.
  static constexpr int kQueryEntries = kRows * HEAD_DIM;
  static constexpr int kStageEntries = N * HEAD_DIM;
  static constexpr int kCaches = kLatent ? 1 : 2;
  static constexpr size_t kRegionBytes =
      QUANTIZED ? kCaches * (2 * kStageEntries + kStages * kStageEntries)
                : kCaches * 2 * kStages * kStageEntries;
  static constexpr size_t kSharedBytes =
      2 * kQueryEntries + kRegionBytes + 12 * kStages * N + (kLatent ? 4 * kRows * N : 0);
  static constexpr int kStreams = kLatent ? 1 : WN;  // online softmaxes per row
  static_assert(4 * kStreams * kRows * (kValueDim + 2) <= 2 * kQueryEntries + kRegionBytes,
                "the epilogue fits in the query, key and value region");
  static constexpr bool kQueryInRegisters = MT == 1 && HEAD_DIM <= 128;
};

/// Entry offset of chunk `chunk` of row `row` in a swizzled tile of HEAD_DIM-entry rows.
template <int HEAD_DIM>
__device__ inline int swizzled(int row, int chunk) {
  return row * HEAD_DIM + ((chunk ^ (row & 7)) << 3);
}

/// 8 consecutive cache entries times their row's scale, as T, stored as one 16-byte chunk.
template <typename T, typename Entry>
__device__ inline void dequantize_chunk(const Entry* src, float scale, T* dst) {
  struct alignas(16) Chunk {
    T entries[8];
  } chunk;
  Entry raw[8];
  __builtin_memcpy(raw, src, sizeof(raw));
#pragma unroll
  for (int i = 0; i < 8; ++i) chunk.entries[i] = from_float<T>(entry_to_float(raw[i]) * scale);
  *reinterpret_cast<Chunk*>(dst) = chunk;
}

/// Query heads per row tile for a GQA group, and tokens per tile: a tile holds whole groups of
/// min(group, rows) heads, for rows / heads tokens.
__host__ __device__ inline int mma_tile_heads(int group, int rows) {
  return group < rows ? group : rows;
}

/// The first tile of sequence b when each takes tiles of `tokens` query tokens: a bound that
/// needs no scan, floor(query_start_loc[b] / tokens) + b; the grid has
/// floor(num_tokens / tokens) + num_seqs tiles and a sequence's surplus tiles exit.
__device__ inline int mma_first_tile(const int32_t* query_start_loc, int b, int tokens) {
  return query_start_loc[b] / tokens + b;
}

/// The sequence of tile `tile`: the last b whose first tile is <= tile.
__device__ inline int mma_sequence_of(const PagedAttentionParams& p, int tile, int tokens) {
  int lo = 0, hi = p.num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (mma_first_tile(p.query_start_loc, mid, tokens) <= tile) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

/// Grid (num_tokens / tile tokens + num_seqs, num_kv_heads * head_blocks_per_kv_head,
/// num_splits), kAttentionThreads threads, Shape::kSharedBytes of dynamic shared memory.
/// T: __nv_bfloat16 or __half; caches of T (kPlain) or int8 / fp8 entries with fp32 row scales;
/// head_dim == value_head_dim == value_row == HEAD_DIM, or over a latent (key_cache ==
/// value_cache, one KV head) head_dim == value_row == HEAD_DIM, value_head_dim ==
/// LATENT_VALUE_DIM; the caches', query's and query rows' addresses are 16-byte aligned (the
/// launcher checks).
template <typename T, KVFormat F, int HEAD_DIM, int WM, int WN, int N, int LATENT_VALUE_DIM = 0,
          int MT = 1>
__global__ void __launch_bounds__(kAttentionThreads)
    paged_attention_mma_kernel(const PagedAttentionParams p) {
  using Entry = typename KVEntry<T, F>::type;
  constexpr bool kQuantized = F != KVFormat::kPlain;
  using Shape = MmaAttentionShape<HEAD_DIM, WM, WN, N, kQuantized, LATENT_VALUE_DIM, MT>;
  constexpr bool kLatent = Shape::kLatent;
  constexpr int kRows = Shape::kRows, kChunks = Shape::kChunks;
  constexpr int kWarpPositions = Shape::kWarpPositions;
  constexpr int kScoreTiles = kWarpPositions / 8;  // 8-position tiles of a warp's scores
  // 8-position tiles of the probabilities a warp multiplies by values: its own scores, or over a
  // latent the whole stage's (the warps exchange their scores).
  constexpr int kProbTiles = kLatent ? N / 8 : kScoreTiles;
  constexpr int kValueTiles = Shape::kOutputDim / 8;  // 8-entry tiles of a warp's output
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr int E = Shape::kStageEntries;
  T* s_query = static_cast<T*>(dynamic_shared_memory());
  unsigned char* s_region = reinterpret_cast<unsigned char*>(s_query + Shape::kQueryEntries);
  // Plain: the stages' rows. Quantized: this stage's rows, dequantized. A latent's values are
  // its key rows.
  T* s_key = reinterpret_cast<T*>(s_region);
  T* s_value = kLatent ? s_key : s_key + (kQuantized ? 1 : Shape::kStages) * E;
  // Quantized: the stages' raw entries and their rows' scales.
  Entry* s_raw_key = reinterpret_cast<Entry*>(s_key + Shape::kCaches * E);
  Entry* s_raw_value = s_raw_key + Shape::kStages * E;
  int* s_valid = reinterpret_cast<int*>(s_region + Shape::kRegionBytes);
  float* s_key_scale = reinterpret_cast<float*>(s_valid + Shape::kStages * N);
  float* s_value_scale = s_key_scale + Shape::kStages * N;
  float* s_scores = s_value_scale + Shape::kStages * N;  // latent: [kRows][N]

  // This block's sequence, query tokens and heads.
  const int group = p.num_heads / p.num_kv_heads;
  const int tile_heads = mma_tile_heads(group, kRows);
  const int tile_tokens = kRows / tile_heads;
  // Tiles run last to first: a prefill's late tiles, with the longest causal spans, start first.
  const int tile = static_cast<int>(gridDim.x - 1 - blockIdx.x);
  const int b = mma_sequence_of(p, tile, tile_tokens);
  const int first_query = p.query_start_loc[b];
  const int query_len = p.query_start_loc[b + 1] - first_query;
  const int q0 = (tile - mma_first_tile(p.query_start_loc, b, tile_tokens)) * tile_tokens;
  if (q0 >= query_len) return;  // a surplus tile (uniform across the block)
  const int tokens = min(tile_tokens, query_len - q0);
  const int kv_head = blockIdx.y / p.head_blocks_per_kv_head;
  const int head0 = kv_head * group + (blockIdx.y % p.head_blocks_per_kv_head) * tile_heads;
  const int heads = min(tile_heads, (kv_head + 1) * group - head0);
  const int first_position = p.seq_lens[b] - query_len + q0;  // of the tile's first token
  // A row's token and head, {-1, -1} past the tile's tokens or heads.
  const auto row_of = [&](int r) {
    const int token = r / tile_heads, head = r % tile_heads;
    return token < tokens && head < heads ? make_int2(first_query + q0 + token, head0 + head)
                                          : make_int2(-1, -1);
  };

  // The positions this block reads: the tile's causal span, its sliding windows, this split.
  const int last_position = first_position + tokens - 1;
  const int context_end = min(last_position + 1, p.max_blocks_per_seq * p.block_size);
  const int window_start =
      p.sliding_window > 0 ? max(0, first_position + 1 - p.sliding_window) : 0;
  const int kv_begin = max(window_start, static_cast<int>(blockIdx.z) * p.partition);
  const int kv_end = min(context_end, static_cast<int>(blockIdx.z + 1) * p.partition);
  const int iterations = kv_end > kv_begin ? (kv_end - kv_begin + N - 1) / N : 0;

  // Queries: row r's entries, zeros for rows of no token or head.
  const T* query = static_cast<const T*>(p.query);
  for (int i = threadIdx.x; i < kRows * kChunks; i += kAttentionThreads) {
    const int r = i / kChunks, chunk = i % kChunks;
    const int2 row = row_of(r);
    const T* src = row.x < 0 ? query
                             : query + static_cast<int64_t>(row.x) * p.query_stride +
                                   static_cast<int64_t>(row.y) * HEAD_DIM + chunk * 8;
    cp_async_16(s_query + swizzled<HEAD_DIM>(r, chunk), src, row.x >= 0);
  }
  cp_async_commit();
  const Entry* key_cache = static_cast<const Entry*>(p.key_cache);
  const Entry* value_cache = static_cast<const Entry*>(p.value_cache);
  const int32_t* table = p.block_tables + static_cast<int64_t>(b) * p.max_blocks_per_seq;
  // Stage `stage` <- the key and value rows of positions [base, base + N) (raw, with their
  // scales, when quantized): zeros and an unset flag past kv_end or in a block outside the pool.
  // A row is HEAD_DIM * sizeof(Entry) / 16 chunks of 16 bytes.
  constexpr int kEntriesPerChunk = 16 / sizeof(Entry);
  constexpr int kCopyChunks = HEAD_DIM / kEntriesPerChunk;
  const auto load_stage = [&](int stage, int base) {
    for (int i = threadIdx.x; i < N * kCopyChunks; i += kAttentionThreads) {
      const int j = i / kCopyChunks, chunk = i % kCopyChunks;
      const int pos = base + j;
      const int block_index = pos < kv_end ? block_of(p, pos) : 0;
      const int block = pos < kv_end ? table[block_index] : -1;
      const bool valid = block >= 0 && block < p.num_blocks;
      const int offset_in_block = pos - block_index * p.block_size;
      const int64_t row =
          valid ? (static_cast<int64_t>(block) * p.block_size + offset_in_block) * p.num_kv_heads +
                      kv_head
                : 0;
      const int64_t offset = row * HEAD_DIM + chunk * kEntriesPerChunk;
      if constexpr (kQuantized) {
        const int at = (stage * N + j) * HEAD_DIM + chunk * kEntriesPerChunk;
        cp_async_16(s_raw_key + at, key_cache + offset, valid);
        if (!kLatent) cp_async_16(s_raw_value + at, value_cache + offset, valid);
        if (chunk == 0) {
          cp_async_4(s_key_scale + stage * N + j, p.key_scale + row, valid);
          if (!kLatent) cp_async_4(s_value_scale + stage * N + j, p.value_scale + row, valid);
        }
      } else {
        cp_async_16(s_key + stage * E + swizzled<HEAD_DIM>(j, chunk), key_cache + offset, valid);
        if (!kLatent) {
          cp_async_16(s_value + stage * E + swizzled<HEAD_DIM>(j, chunk), value_cache + offset,
                      valid);
        }
      }
      if (chunk == 0) s_valid[stage * N + j] = valid;
    }
  };
  // Quantized: this stage's raw rows times their scales, as T, into the swizzled K and V tiles.
  const auto dequantize_stage = [&](int stage) {
    for (int i = threadIdx.x; i < N * kChunks; i += kAttentionThreads) {
      const int j = i / kChunks, chunk = i % kChunks;
      const int at = (stage * N + j) * HEAD_DIM + chunk * 8;
      dequantize_chunk<T>(s_raw_key + at, s_key_scale[stage * N + j],
                          s_key + swizzled<HEAD_DIM>(j, chunk));
      if (!kLatent) {
        dequantize_chunk<T>(s_raw_value + at, s_value_scale[stage * N + j],
                            s_value + swizzled<HEAD_DIM>(j, chunk));
      }
    }
  };
  if (iterations > 0) load_stage(0, kv_begin);
  cp_async_commit();

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int wm = warp / WN, wn = warp % WN;
  const int g = lane / 4, c = lane % 4;
  // This lane's two rows of each of the warp's row tiles (g and g + 8 of its 16 rows): the
  // positions they attend to (none for a row of no token or head).
  int lowest[MT][2], highest[MT][2];
  float out[MT][kValueTiles][4] = {}, running_max[MT][2], running_sum[MT][2] = {};
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = 16 * (MT * wm + mt) + g + 8 * i;
      const bool used = row_of(r).x >= 0;
      const int position = first_position + r / tile_heads;
      highest[mt][i] = used ? position : -1;
      lowest[mt][i] = p.sliding_window > 0 ? position + 1 - p.sliding_window : 0;
      running_max[mt][i] = -INFINITY;
    }
  }
  // The A fragment of row tile mt's 16 query rows, entries [16 kk, 16 kk + 16).
  const auto load_query = [&](int kk, int mt, uint32_t(&frag)[4]) {
    const int row = 16 * (MT * wm + mt) + lane % 16;
    ldmatrix_x4<false>(frag, s_query + swizzled<HEAD_DIM>(row, 2 * kk + lane / 16));
  };
  constexpr int kHeldTiles = Shape::kQueryInRegisters ? MT : 1;
  uint32_t q_frag[kHeldTiles][Shape::kQueryInRegisters ? HEAD_DIM / 16 : 1][4];
  cp_async_wait<1>();  // the queries
  __syncthreads();
  if constexpr (Shape::kQueryInRegisters) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int kk = 0; kk < HEAD_DIM / 16; ++kk) load_query(kk, mt, q_frag[mt][kk]);
    }
  }
  const float score_scale = p.logit_softcap > 0.0f ? p.scale / p.logit_softcap : p.scale * kLog2e;

  for (int it = 0; it < iterations; ++it) {
    const int stage = it % Shape::kStages;
    if (it + 1 < iterations) load_stage(stage ^ 1, kv_begin + (it + 1) * N);
    cp_async_commit();
    cp_async_wait<1>();  // this stage's rows (the next stage's may still be in flight)
    __syncthreads();
    if constexpr (kQuantized) {
      dequantize_stage(stage);
      __syncthreads();
    }
    const T* keys = s_key + (kQuantized ? 0 : stage * E);
    const T* values = s_value + (kQuantized ? 0 : stage * E);
    const int first = wn * kWarpPositions;  // this warp's first row of the stage
    const int base = kv_begin + it * N + first;

    // S = Q K^T: each ldmatrix gives the B fragments of two 8-position tiles, for every row
    // tile of the warp.
    float score[MT][kScoreTiles][4] = {};
    uint32_t key_frag[4];
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if constexpr (Shape::kQueryInRegisters) {
#pragma unroll
          for (int r = 0; r < 4; ++r) a[mt][r] = q_frag[mt][kk][r];
        } else {
          load_query(kk, mt, a[mt]);
        }
      }
      if constexpr (kScoreTiles == 1) {
        // One 8-position tile: each ldmatrix gives its B fragments for two steps of 16 entries.
        if (kk % 2 == 0) {
          ldmatrix_x4<false>(key_frag, keys + swizzled<HEAD_DIM>(first + lane % 8,
                                                                 2 * kk + lane / 8));
        }
        const uint32_t b[2] = {key_frag[2 * (kk % 2)], key_frag[2 * (kk % 2) + 1]};
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) mma_m16n8k16<T>(score[mt][0], a[mt], b);
      } else {
#pragma unroll
        for (int nt = 0; nt < kScoreTiles; nt += 2) {
          uint32_t frag[4];
          const int j = first + nt * 8 + (lane / 16) * 8 + lane % 8;
          ldmatrix_x4<false>(frag, keys + swizzled<HEAD_DIM>(j, 2 * kk + (lane / 8) % 2));
          const uint32_t b0[2] = {frag[0], frag[1]}, b1[2] = {frag[2], frag[3]};
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma_m16n8k16<T>(score[mt][nt], a[mt], b0);
            mma_m16n8k16<T>(score[mt][nt + 1], a[mt], b1);
          }
        }
      }
    }
    // Scale (log2 units) and soft-cap; mask, unless every position of the warp's share of the
    // stage holds a row and lies in every used row's causal span and window (a prefill's tiles
    // below the diagonal), the warp deciding as one.
    bool unmasked = true;
    for (int j = lane; j < kWarpPositions; j += 32) unmasked &= s_valid[stage * N + first + j] != 0;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        unmasked &= highest[mt][i] < 0 ||
                    (lowest[mt][i] <= base && base + kWarpPositions - 1 <= highest[mt][i]);
      }
    }
    unmasked = __all_sync(0xffffffffu, unmasked);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int nt = 0; nt < kScoreTiles; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = score[mt][nt][e] * score_scale;
          if (p.logit_softcap > 0.0f) x = p.logit_softcap * kLog2e * tanhf(x);
          score[mt][nt][e] = x;
        }
      }
    }
    if (!unmasked) {  // one uniform branch, not a predicated mask per score
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int nt = 0; nt < kScoreTiles; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int pos = base + nt * 8 + 2 * c + e % 2, i = e / 2;
            const bool valid = s_valid[stage * N + pos - (base - first)] &&
                               pos >= lowest[mt][i] && pos <= highest[mt][i];
            if (!valid) score[mt][nt][e] = -INFINITY;
          }
        }
      }
    }
    // The scores of the positions this warp multiplies by values (prob), and their first row.
    float prob[MT][kProbTiles][4];
    int prob_first = first;
    if constexpr (kLatent) {
      // Every warp needs the whole stage's scores: it holds a quarter of each value row.
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s_scores[(g + 8 * (e / 2)) * N + first + 2 * c + e % 2] = score[0][0][e];
      }
      __syncthreads();
#pragma unroll
      for (int nt = 0; nt < kProbTiles; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          prob[0][nt][e] = s_scores[(g + 8 * (e / 2)) * N + nt * 8 + 2 * c + e % 2];
        }
      }
      prob_first = 0;
    } else {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int nt = 0; nt < kProbTiles; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) prob[mt][nt][e] = score[mt][nt][e];
        }
      }
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float tile_max = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < kProbTiles; ++nt) {
          tile_max = fmaxf(tile_max, fmaxf(prob[mt][nt][2 * i], prob[mt][nt][2 * i + 1]));
        }
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
        const float new_max = fmaxf(running_max[mt][i], tile_max);
        const float shift = new_max == -INFINITY ? 0.0f : new_max;  // a row with nothing yet
        const float correction = exp2_approx(running_max[mt][i] - shift);
        running_sum[mt][i] *= correction;
#pragma unroll
        for (int dt = 0; dt < kValueTiles; ++dt) {
          out[mt][dt][2 * i] *= correction;
          out[mt][dt][2 * i + 1] *= correction;
        }
#pragma unroll
        for (int nt = 0; nt < kProbTiles; ++nt) {
#pragma unroll
          for (int e = 2 * i; e < 2 * i + 2; ++e) {
            prob[mt][nt][e] = exp2_approx(prob[mt][nt][e] - shift);
            running_sum[mt][i] += prob[mt][nt][e];
          }
        }
        running_max[mt][i] = new_max;
      }
    }
    // O += P V: P's A fragments are two probability tiles; a transposed ldmatrix gives V's B
    // fragments of two 8-entry output tiles (of this warp's quarter over a latent).
    const int first_chunk = kLatent ? wn * (Shape::kOutputDim / 8) : 0;
#pragma unroll
    for (int kt = 0; kt < kProbTiles / 2; ++kt) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const float(&s0)[4] = prob[mt][2 * kt];
        const float(&s1)[4] = prob[mt][2 * kt + 1];
        a[mt][0] = pack_pair<T>(s0[0], s0[1]);
        a[mt][1] = pack_pair<T>(s0[2], s0[3]);
        a[mt][2] = pack_pair<T>(s1[0], s1[1]);
        a[mt][3] = pack_pair<T>(s1[2], s1[3]);
      }
      const int j = prob_first + 16 * kt + ((lane / 8) % 2) * 8 + lane % 8;
#pragma unroll
      for (int dt = 0; dt < kValueTiles; dt += 2) {
        uint32_t frag[4];
        ldmatrix_x4<true>(frag, values + swizzled<HEAD_DIM>(j, first_chunk + dt + lane / 16));
        const uint32_t b0[2] = {frag[0], frag[1]}, b1[2] = {frag[2], frag[3]};
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_m16n8k16<T>(out[mt][dt], a[mt], b0);
          mma_m16n8k16<T>(out[mt][dt + 1], a[mt], b1);
        }
      }
    }
    __syncthreads();  // every warp is done with this stage before it is loaded again
  }
  cp_async_wait<0>();

  // The lanes of a quad hold parts of their rows' sums.
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      running_sum[mt][i] += __shfl_xor_sync(0xffffffffu, running_sum[mt][i], 1);
      running_sum[mt][i] += __shfl_xor_sync(0xffffffffu, running_sum[mt][i], 2);
    }
  }
  __syncthreads();  // the stages are free (a block with no iteration reaches here directly)
  float* e_max = reinterpret_cast<float*>(s_query);
  float* e_sum = e_max + Shape::kStreams * kRows;
  float* e_acc = e_sum + Shape::kStreams * kRows;
  constexpr int kAccWidth = Shape::kValueDim;
  // Each warp's stream, or over a latent one stream whose values the warps hold in quarters.
  const int stream = kLatent ? 0 : wn;
  const int first_entry = kLatent ? wn * Shape::kOutputDim : 0;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int slot = stream * kRows + 16 * (MT * wm + mt) + g + 8 * i;
      if (c == 0 && (!kLatent || wn == 0)) {
        e_max[slot] = running_max[mt][i];
        e_sum[slot] = running_sum[mt][i];
      }
#pragma unroll
      for (int dt = 0; dt < kValueTiles; ++dt) {
        const int d = first_entry + 8 * dt + 2 * c;
        e_acc[slot * kAccWidth + d] = out[mt][dt][2 * i];
        e_acc[slot * kAccWidth + d + 1] = out[mt][dt][2 * i + 1];
      }
    }
  }
  __syncthreads();
  store_merged_rows<T, true>(p, kRows, Shape::kStreams, e_max, e_sum, e_acc, kRows, kAccWidth,
                             row_of);
}

}  // namespace kvserve::cuda
