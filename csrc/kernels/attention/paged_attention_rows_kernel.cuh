#pragma once
// CUDA body of paged_attention for keys and values of one size, 64, 128 or 256 (contract:
// paged_attention.h), in the split-K layout of paged_attention_kernel.cuh but built for memory
// bandwidth: a key or value row is read by HEAD_DIM / 8 lanes, 8 entries each in one vector
// load, so a warp reads 32 / (HEAD_DIM / 8) rows per load, and every lane loads the ROWS key and
// value rows of its next iteration before it uses those of this one (software pipelining); block
// ids come from the block table through a multiply-shift division. Each row group of lanes is its
// own softmax stream: a score is a reduction over the group's lanes only, and the stream updates
// its running max, sum and weighted values once per ROWS positions, in base 2 (exp2 of
// log2(e)-scaled scores). The streams of a block merge in shared memory at the end; several
// splits merge in paged_attention_merge_kernel. Raw pointers only, no torch headers; the launcher
// checks shapes, dtypes and the alignment of the caches.

#include <cfloat>
#include <cstdint>

#include "kernels/attention/paged_attention_kernel.cuh"
#include "kernels/cuda_dtype.cuh"

namespace kvserve::cuda {

/// 8 consecutive entries of a row as one load: 8, 16 or 32 bytes.
template <int BYTES>
struct alignas(BYTES < 16 ? BYTES : 16) RowChunk {
  uint4 words[BYTES / 16];
};
template <>
struct alignas(8) RowChunk<8> {
  uint2 words;
};

template <typename Entry>
using ChunkOf = RowChunk<8 * sizeof(Entry)>;

template <typename Entry>
__device__ inline ChunkOf<Entry> load_chunk(const Entry* src) {
  return *reinterpret_cast<const ChunkOf<Entry>*>(src);
}

/// The chunk's 8 entries as fp32, times `scale`.
template <typename Entry>
__device__ inline void unpack_chunk(const ChunkOf<Entry>& chunk, float scale, float (&out)[8]) {
  const Entry* entries = reinterpret_cast<const Entry*>(&chunk);
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = entry_to_float(entries[i]) * scale;
}

/// Query heads per block of the row kernel for a GQA group: the smallest of 1, 2, 4, 8 that
/// holds it (wider groups take several blocks per KV head).
constexpr int rows_heads_per_block(int group) {
  return group <= 1 ? 1 : group <= 2 ? 2 : group <= 4 ? 4 : 8;
}

/// Positions a block of the row kernel covers per iteration.
template <int HEAD_DIM, int ROWS>
constexpr int rows_kernel_step() {
  return kAttentionWarps * (32 / (HEAD_DIM / 8)) * ROWS;
}

/// Grid (num_tokens, num_kv_heads * head_blocks_per_kv_head, num_splits), kAttentionThreads
/// threads; head_dim == value_head_dim == the value rows' width == HEAD_DIM. HPB: query heads
/// per block; ROWS: positions per lane in flight. Positions are dealt round-robin to the
/// block's row groups, so each split's positions spread over all of them.
template <typename T, KVFormat F, int HEAD_DIM, int HPB, int ROWS>
__global__ void __launch_bounds__(kAttentionThreads)
    paged_attention_rows_kernel(const PagedAttentionParams p) {
  using Entry = typename KVEntry<T, F>::type;
  constexpr int kLanes = HEAD_DIM / 8;                       // lanes per row
  constexpr int kStreams = kAttentionWarps * (32 / kLanes);  // row groups per block
  constexpr float kLog2e = 1.4426950408889634f;
  __shared__ float s_max[kStreams][HPB], s_sum[kStreams][HPB];
  __shared__ float s_acc[kStreams][HPB][HEAD_DIM];
  const int lane = threadIdx.x % 32;
  const int part = lane % kLanes;  // entries [8 * part, 8 * part + 8) of each row
  const int stream = threadIdx.x / kLanes;
  const int t = blockIdx.x;
  const int b = sequence_of(p.query_start_loc, p.num_seqs, t);
  const int first_query = p.query_start_loc[b];
  const int position = p.seq_lens[b] - (p.query_start_loc[b + 1] - first_query) + (t - first_query);
  const int end = min(position + 1, p.max_blocks_per_seq * p.block_size);
  const int start = p.sliding_window > 0 ? max(0, position + 1 - p.sliding_window) : 0;
  const int split_begin = max(start, static_cast<int>(blockIdx.z) * p.partition);
  const int split_end = min(end, static_cast<int>(blockIdx.z + 1) * p.partition);

  const int group = p.num_heads / p.num_kv_heads;
  const int kv_head = blockIdx.y / p.head_blocks_per_kv_head;
  const int head0 = kv_head * group + (blockIdx.y % p.head_blocks_per_kv_head) * HPB;
  const int heads = min(HPB, (kv_head + 1) * group - head0);

  // Queries times the scale; heads past the group stay zero and are never written.
  float q[HPB][8], acc[HPB][8], running_max[HPB], running_sum[HPB];
  const T* query = static_cast<const T*>(p.query) + t * p.query_stride + part * 8;
#pragma unroll
  for (int h = 0; h < HPB; ++h) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      q[h][i] = h < heads ? to_float(query[(head0 + h) * HEAD_DIM + i]) * p.scale : 0.0f;
      acc[h][i] = 0.0f;
    }
    running_max[h] = -FLT_MAX;
    running_sum[h] = 0.0f;
  }

  const Entry* key_cache = static_cast<const Entry*>(p.key_cache) + part * 8;
  const Entry* value_cache = static_cast<const Entry*>(p.value_cache) + part * 8;
  const int32_t* table = p.block_tables + static_cast<int64_t>(b) * p.max_blocks_per_seq;
  // This lane's ROWS key and value rows at positions base + r * kStreams + stream (zeros and
  // invalid past split_end or in a block outside the pool).
  struct Rows {
    ChunkOf<Entry> key[ROWS], value[ROWS];
    float key_scale[ROWS], value_scale[ROWS];
    bool valid[ROWS];
  };
  const auto load_rows = [&](int base, Rows& rows) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const int pos = base + r * kStreams + stream;
      const int block_index = block_of(p, pos);
      const int block = pos < split_end ? table[block_index] : -1;
      rows.valid[r] = block >= 0 && block < p.num_blocks;
      // The row's index in the cache (and its scale's), [block][offset][kv_head].
      const int64_t row =
          rows.valid[r] ? (static_cast<int64_t>(block) * p.block_size +
                           (pos - block_index * p.block_size)) * p.num_kv_heads + kv_head
                        : 0;
      rows.key[r] = {};
      rows.value[r] = {};
      if (rows.valid[r]) {
        rows.key[r] = load_chunk(key_cache + row * HEAD_DIM);
        rows.value[r] = load_chunk(value_cache + row * HEAD_DIM);
      }
      rows.key_scale[r] = F == KVFormat::kPlain || !rows.valid[r] ? 1.0f : p.key_scale[row];
      rows.value_scale[r] = F == KVFormat::kPlain || !rows.valid[r] ? 1.0f : p.value_scale[row];
    }
  };
  // Software pipelining: the next iteration's rows are in flight while this one's are used.
  Rows next;
  load_rows(split_begin, next);
  for (int base = split_begin; base < split_end; base += kStreams * ROWS) {
    const Rows current = next;
    load_rows(base + kStreams * ROWS, next);
    const auto& key = current.key;
    const auto& value = current.value;
    const auto& key_scale = current.key_scale;
    const auto& value_scale = current.value_scale;
    const auto& valid = current.valid;
    // Scores in log2 units; a masked position scores -inf and weighs exp2(-inf) = 0.
    float score[ROWS][HPB];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      float k[8];
      unpack_chunk<Entry>(key[r], key_scale[r], k);
#pragma unroll
      for (int h = 0; h < HPB; ++h) {
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) dot += q[h][i] * k[i];
#pragma unroll
        for (int offset = kLanes / 2; offset > 0; offset /= 2) {
          dot += __shfl_xor_sync(0xffffffffu, dot, offset);
        }
        if (p.logit_softcap > 0.0f) dot = p.logit_softcap * tanhf(dot / p.logit_softcap);
        score[r][h] = valid[r] ? dot * kLog2e : -INFINITY;
      }
    }
    float weight[ROWS][HPB];
#pragma unroll
    for (int h = 0; h < HPB; ++h) {
      float new_max = running_max[h];
#pragma unroll
      for (int r = 0; r < ROWS; ++r) new_max = fmaxf(new_max, score[r][h]);
      const float correction = exp2f(running_max[h] - new_max);
      running_sum[h] *= correction;
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[h][i] *= correction;
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        weight[r][h] = exp2f(score[r][h] - new_max);
        running_sum[h] += weight[r][h];
      }
      running_max[h] = new_max;
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      float v[8];
      unpack_chunk<Entry>(value[r], value_scale[r], v);
#pragma unroll
      for (int h = 0; h < HPB; ++h) {
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[h][i] += weight[r][h] * v[i];
      }
    }
  }

#pragma unroll
  for (int h = 0; h < HPB; ++h) {
    if (part == 0) {
      s_max[stream][h] = running_max[h];
      s_sum[stream][h] = running_sum[h];
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) s_acc[stream][h][part * 8 + i] = acc[h][i];
  }
  __syncthreads();
  store_merged_rows<T, true>(p, heads, kStreams, &s_max[0][0], &s_sum[0][0], &s_acc[0][0][0], HPB,
                             HEAD_DIM, [&](int h) { return make_int2(t, head0 + h); });
}

}  // namespace kvserve::cuda
