#pragma once
// CUDA bodies of paged_attention (contract: paged_attention.h), split-K ("flash-decoding"):
// one thread block per (query token, group of query heads that share a KV head, context split).
// Each of its warps walks every kWarps-th position of the split: the lanes hold strided
// dimensions of the queries, accumulators and the key/value rows, a warp-wide sum gives each
// score, and an online softmax in fp32 keeps a running max, sum and weighted value per head. The
// warps then merge in shared memory; with several splits a second kernel merges the splits'
// normalized partial outputs by their maxima and sums. A query's heads share every key and value
// row it reads (GQA/MQA, and MLA's latent as both), so each row is read once per block.
// Raw pointers only, no torch headers; the launcher checks shapes and dtypes.

#include <cfloat>
#include <cstdint>

#include "kernels/cuda_dtype.cuh"
#include "kernels/cuda_reduce.cuh"

namespace kvserve::cuda {

constexpr int kAttentionWarps = 4;
constexpr int kAttentionThreads = 32 * kAttentionWarps;

/// One paged_attention call; see paged_attention.h. Entries of the caches are T (kPlain) or
/// int8 / fp8 with fp32 scales [num_blocks * block_size * num_kv_heads].
struct PagedAttentionParams {
  void* out;
  const void* query;
  const void* key_cache;
  const void* value_cache;
  const float* key_scale;
  const float* value_scale;
  const int32_t* query_start_loc;
  const int32_t* seq_lens;
  const int32_t* block_tables;
  float* partial_out;  // splits > 1: [num_tokens, num_heads, num_splits, value_head_dim]
  float* partial_max;  // [num_tokens, num_heads, num_splits]
  float* partial_sum;  // [num_tokens, num_heads, num_splits]
  int64_t out_stride, query_stride;
  int64_t cache_block_stride, value_cache_block_stride, value_row;
  int num_seqs, num_heads, num_kv_heads, head_dim, value_head_dim;
  int block_size, max_blocks_per_seq, num_blocks;
  // position / block_size as __umulhi(position, block_mul) >> block_shift (block_mul 0: the
  // block size is 1), for positions below 2^31: host_block_divisor() sets them.
  uint32_t block_mul;
  int block_shift;
  int head_blocks_per_kv_head;  // thread blocks per KV head: ceil(group / heads per block)
  int num_splits, partition;    // split z covers positions [z * partition, (z + 1) * partition)
  float scale;
  int sliding_window;   // <= 0: none
  float logit_softcap;  // <= 0: none
  const float* sinks;   // [num_heads]: a logit per head in each softmax (gpt-oss); null: none
};

/// Sets p.block_mul and p.block_shift for p.block_size >= 1 (0 reads as 1): a round-up
/// reciprocal, as CUTLASS's FastDivmod, exact for every dividend below 2^31.
inline void host_block_divisor(PagedAttentionParams& p) {
  const uint32_t d = static_cast<uint32_t>(p.block_size);
  int log2_up = 0;
  while ((1u << log2_up) < d) ++log2_up;
  const int shift = 31 + log2_up;
  p.block_mul = d <= 1 ? 0u : static_cast<uint32_t>(((1ull << shift) + d - 1) / d);
  p.block_shift = d <= 1 ? 0 : shift - 32;
}

/// position / block_size for 0 <= position < 2^31 (see host_block_divisor).
__device__ inline int block_of(const PagedAttentionParams& p, int position) {
  return p.block_mul == 0 ? position
                          : static_cast<int>(__umulhi(static_cast<uint32_t>(position),
                                                      p.block_mul) >> p.block_shift);
}

/// The sequence of query token t: the last b with query_start_loc[b] <= t.
__device__ inline int sequence_of(const int32_t* query_start_loc, int num_seqs, int t) {
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (query_start_loc[mid] <= t) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

/// One output entry of a row merged from its online-softmax streams (a block's warps, or the
/// splits of a context): stream(s) gives float3{max (base-2 units when LOG2), sum of weights,
/// value weighted as the sum is}. Streams that saw no position (sum 0) drop out; a NaN sum (NaN
/// scores: a model gone bad) makes the row NaN, as on the CPU, rather than zeros. Returns the
/// merged max, the total weight and the normalized value (0 for a row that saw no position).
struct MergedSoftmax {
  float max, total, value;
};
template <bool LOG2, typename Stream>
__device__ inline MergedSoftmax merge_softmax_streams(int streams, Stream stream) {
  MergedSoftmax m{-FLT_MAX, 0.0f, 0.0f};
  for (int s = 0; s < streams; ++s) {
    const float3 x = stream(s);
    if (x.y != 0.0f) m.max = fmaxf(m.max, x.x);
  }
  float value = 0.0f;
  for (int s = 0; s < streams; ++s) {
    const float3 x = stream(s);
    if (x.y == 0.0f) continue;
    const float w = LOG2 ? exp2f(x.x - m.max) : expf(x.x - m.max);
    m.total += x.y * w;
    value += x.z * w;
  }
  m.value = m.total == 0.0f ? 0.0f : value / m.total;
  return m;
}

/// The epilogue of the split-K kernels: each output row r (a query token and head, as row_of(r)
/// gives them, {-1, -1} for none) has `streams` online-softmax streams in shared memory, stream
/// s's running max at s_max[s * row_stride + r] (log2 units when LOG2, natural otherwise), its
/// sum at s_sum[same] and its unnormalized values at s_acc[(s * row_stride + r) * acc_width + d].
/// Merges them and stores each row normalized in `out` (one split) or as split blockIdx.z's
/// partial output, max (natural units) and sum for paged_attention_merge_kernel. A stream that saw
/// no position has sum 0; a row that saw none stores zeros. A head's sink (p.sinks) joins the
/// final merge as one more stream (max: the sink, sum 1, no value).
template <typename T, bool LOG2, typename RowOf>
__device__ inline void store_merged_rows(const PagedAttentionParams& p, int rows, int streams,
                                         const float* s_max, const float* s_sum,
                                         const float* s_acc, int row_stride, int acc_width,
                                         RowOf row_of) {
  constexpr float kLog2e = 1.4426950408889634f;
  const int dv = p.value_head_dim;
  for (int i = threadIdx.x; i < rows * dv; i += blockDim.x) {
    const int r = i / dv, d = i % dv;
    const int2 row = row_of(r);
    if (row.x < 0) continue;
    // One more stream, the sink, when this is the final merge.
    const bool sink = p.sinks && p.num_splits == 1;
    const MergedSoftmax m = merge_softmax_streams<LOG2>(streams + sink, [&](int s) {
      if (s == streams) return make_float3(p.sinks[row.y] * (LOG2 ? kLog2e : 1.0f), 1.0f, 0.0f);
      const int slot = s * row_stride + r;
      return make_float3(s_max[slot], s_sum[slot],
                         s_acc[static_cast<int64_t>(slot) * acc_width + d]);
    });
    if (p.num_splits == 1) {
      static_cast<T*>(p.out)[row.x * p.out_stride + static_cast<int64_t>(row.y) * dv + d] =
          from_float<T>(m.value);
    } else {
      const int64_t index =
          (static_cast<int64_t>(row.x) * p.num_heads + row.y) * p.num_splits + blockIdx.z;
      p.partial_out[index * dv + d] = m.value;
      if (d == 0) {
        p.partial_max[index] = LOG2 ? m.max / kLog2e : m.max;
        p.partial_sum[index] = m.total;
      }
    }
  }
}

/// Grid (num_tokens, num_kv_heads * head_blocks_per_kv_head, num_splits), kAttentionThreads
/// threads. DPL: dimensions per lane, >= ceil(max(head_dim, value_head_dim) / 32); HPB: query
/// heads per block. A block id outside the pool reads as a masked position (the host checks the
/// metadata where it can read it; a kernel must not read past the cache).
template <typename T, KVFormat F, int DPL, int HPB>
__global__ void __launch_bounds__(kAttentionThreads)
    paged_attention_kernel(const PagedAttentionParams p) {
  using Entry = typename KVEntry<T, F>::type;
  __shared__ float s_max[kAttentionWarps][HPB], s_sum[kAttentionWarps][HPB];
  __shared__ float s_acc[kAttentionWarps][HPB][DPL * 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
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

  float q[HPB][DPL], acc[HPB][DPL], running_max[HPB], running_sum[HPB];
  const T* query = static_cast<const T*>(p.query) + t * p.query_stride;
#pragma unroll
  for (int h = 0; h < HPB; ++h) {
#pragma unroll
    for (int j = 0; j < DPL; ++j) {
      const int d = lane + 32 * j;
      q[h][j] = h < heads && d < p.head_dim ? to_float(query[(head0 + h) * p.head_dim + d]) : 0.0f;
      acc[h][j] = 0.0f;
    }
    running_max[h] = -FLT_MAX;
    running_sum[h] = 0.0f;
  }

  const Entry* key_cache = static_cast<const Entry*>(p.key_cache);
  const Entry* value_cache = static_cast<const Entry*>(p.value_cache);
  const int32_t* table = p.block_tables + static_cast<int64_t>(b) * p.max_blocks_per_seq;
  constexpr int kUnroll = 2;  // positions in flight per warp
  for (int base = split_begin + warp; base < split_end; base += kAttentionWarps * kUnroll) {
    float k[kUnroll][DPL], v[kUnroll][DPL];
    bool valid[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int pos = base + u * kAttentionWarps;
      const int block = pos < split_end ? table[pos / p.block_size] : -1;
      valid[u] = block >= 0 && block < p.num_blocks;
      const int64_t block_start = valid[u] ? static_cast<int64_t>(block) : 0;
      const int64_t slot = valid[u] ? (pos % p.block_size) * p.num_kv_heads + kv_head : 0;
      const int64_t row = block_start * p.block_size * p.num_kv_heads + slot;  // its scale's index
      const Entry* key = key_cache + block_start * p.cache_block_stride + slot * p.head_dim;
      const Entry* value =
          value_cache + block_start * p.value_cache_block_stride + slot * p.value_row;
      const float key_scale = F == KVFormat::kPlain || !valid[u] ? 1.0f : p.key_scale[row];
      const float value_scale = F == KVFormat::kPlain || !valid[u] ? 1.0f : p.value_scale[row];
#pragma unroll
      for (int j = 0; j < DPL; ++j) {
        const int d = lane + 32 * j;
        k[u][j] = valid[u] && d < p.head_dim ? entry_to_float(key[d]) * key_scale : 0.0f;
        v[u][j] = valid[u] && d < p.value_head_dim ? entry_to_float(value[d]) * value_scale : 0.0f;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (!valid[u]) continue;  // uniform across the warp
#pragma unroll
      for (int h = 0; h < HPB; ++h) {
        if (h >= heads) break;
        float dot = 0.0f;
#pragma unroll
        for (int j = 0; j < DPL; ++j) dot += q[h][j] * k[u][j];
        float score = warp_sum(dot) * p.scale;
        if (p.logit_softcap > 0.0f) score = p.logit_softcap * tanhf(score / p.logit_softcap);
        const float new_max = fmaxf(running_max[h], score);
        const float correction = expf(running_max[h] - new_max);
        const float weight = expf(score - new_max);
        running_sum[h] = running_sum[h] * correction + weight;
#pragma unroll
        for (int j = 0; j < DPL; ++j) acc[h][j] = acc[h][j] * correction + weight * v[u][j];
        running_max[h] = new_max;
      }
    }
  }

#pragma unroll
  for (int h = 0; h < HPB; ++h) {
    if (lane == 0) {
      s_max[warp][h] = running_max[h];
      s_sum[warp][h] = running_sum[h];
    }
#pragma unroll
    for (int j = 0; j < DPL; ++j) s_acc[warp][h][lane + 32 * j] = acc[h][j];
  }
  __syncthreads();
  store_merged_rows<T, false>(p, heads, kAttentionWarps, &s_max[0][0], &s_sum[0][0],
                              &s_acc[0][0][0], HPB, DPL * 32,
                              [&](int h) { return make_int2(t, head0 + h); });
}

/// Grid (num_tokens, num_heads), any block size: out = the splits' partial outputs weighted by
/// sum_z * exp(max_z - max), normalized (with the head's sink as one more split of no value).
template <typename T>
__global__ void paged_attention_merge_kernel(const PagedAttentionParams p) {
  const int64_t index = (static_cast<int64_t>(blockIdx.x) * p.num_heads + blockIdx.y) *
                        p.num_splits;
  const int dv = p.value_head_dim;
  T* out = static_cast<T*>(p.out) + blockIdx.x * p.out_stride +
           static_cast<int64_t>(blockIdx.y) * dv;
  for (int d = threadIdx.x; d < dv; d += blockDim.x) {
    const MergedSoftmax m = merge_softmax_streams<false>(p.num_splits + (p.sinks != nullptr),
                                                         [&](int z) {
      if (z == p.num_splits) return make_float3(p.sinks[blockIdx.y], 1.0f, 0.0f);
      const float sum = p.partial_sum[index + z];
      return make_float3(p.partial_max[index + z], sum, p.partial_out[(index + z) * dv + d] * sum);
    });
    out[d] = from_float<T>(m.value);
  }
}

}  // namespace kvserve::cuda
