#pragma once
// CUDA body of moe_routing (contract: moe_routing.h): one warp per token. The lanes stride over
// the experts for the softmax's max and sum, then pick the best groups and the best experts by
// warp-wide argmax rounds (lower id on equal values, NaN below every number), one round per pick:
// topk_group + top_k rounds of num_experts / 32 comparisons each, cheap next to the expert GEMMs.
// Shared memory per warp: num_experts floats of scores, num_experts of choices, n_group of group
// scores, and num_experts + n_group bytes of taken flags (the launcher sizes it, see
// moe_routing_shared_bytes). Raw pointers only, no torch headers; the launcher checks arguments.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/cuda_dtype.cuh"
#include "kernels/cuda_reduce.cuh"

#include <cstdint>

namespace kvserve::cuda {

namespace routing_detail {

// Whether (a, ia) ranks ahead of (b, ib): the greater value, NaN below every number, then the
// lower id. Ids < 0 mark "no candidate" and rank last.
__device__ inline bool ahead(float a, int64_t ia, float b, int64_t ib) {
  if (ib < 0) return ia >= 0;
  if (ia < 0) return false;
  const bool na = isnan(a), nb = isnan(b);
  if (na != nb) return nb;
  if (!na && a != b) return a > b;
  return ia < ib;
}

// The best (value, id) over the warp's lanes.
__device__ inline void warp_best(float& value, int64_t& id) {
  for (int offset = 16; offset > 0; offset /= 2) {
    const float v = __shfl_xor_sync(0xffffffffu, value, offset);
    const int64_t i = __shfl_xor_sync(0xffffffffu, id, offset);
    if (ahead(v, i, value, id)) {
      value = v;
      id = i;
    }
  }
}

}  // namespace routing_detail

/// Shared memory bytes for `warps` warps per block.
__host__ __device__ inline int64_t moe_routing_shared_bytes(int64_t warps, int64_t num_experts,
                                                            int64_t n_group) {
  return warps * ((2 * num_experts + n_group) * 4 + ((num_experts + n_group + 3) / 4) * 4);
}

/// Grid ceil(num_tokens / warps), block 32 * warps threads, dynamic shared memory
/// moe_routing_shared_bytes(warps, num_experts, n_group). logits [num_tokens, num_experts] with
/// row stride logits_stride; bias fp32 [num_experts] or null; weights fp32 and ids int64
/// [num_tokens, top_k].
template <typename T>
__global__ void moe_routing_kernel(const T* logits, int64_t logits_stride, const float* bias,
                                   int64_t num_tokens, int64_t num_experts, int64_t top_k,
                                   bool sigmoid, int64_t n_group, int64_t topk_group,
                                   bool renormalize, float routed_scaling_factor, float* weights,
                                   int64_t* ids) {
  using namespace routing_detail;
  extern __shared__ float shared[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + warp;
  if (t >= num_tokens) return;  // whole warps leave together
  float* base = reinterpret_cast<float*>(reinterpret_cast<char*>(shared) +
                                         moe_routing_shared_bytes(warp, num_experts, n_group));
  float* scores = base;
  float* choice = scores + num_experts;
  float* group_score = choice + num_experts;
  bool* taken = reinterpret_cast<bool*>(group_score + n_group);  // experts, then groups
  bool* group_kept = taken + num_experts;

  const T* row = logits + t * logits_stride;
  float max = -INFINITY;
  for (int64_t e = lane; e < num_experts; e += 32) {
    scores[e] = to_float(row[e]);
    max = fmaxf(max, scores[e]);
    taken[e] = false;
  }
  max = warp_max(max);
  float sum = 0.0f;
  for (int64_t e = lane; e < num_experts; e += 32) {
    scores[e] = sigmoid ? 1.0f / (1.0f + expf(-scores[e])) : expf(scores[e] - max);
    sum += scores[e];
  }
  sum = warp_sum(sum);
  for (int64_t e = lane; e < num_experts; e += 32) {
    if (!sigmoid) scores[e] /= sum;
    choice[e] = bias ? scores[e] + bias[e] : scores[e];
  }
  __syncwarp();

  const int64_t per_group = num_experts / n_group;
  if (n_group > 1) {
    for (int64_t g = lane; g < n_group; g += 32) {
      float first = NAN, second = NAN;
      int64_t first_id = -1, second_id = -1;
      for (int64_t e = g * per_group; e < (g + 1) * per_group; ++e) {
        if (ahead(choice[e], e, first, first_id)) {
          second = first;
          second_id = first_id;
          first = choice[e];
          first_id = e;
        } else if (ahead(choice[e], e, second, second_id)) {
          second = choice[e];
          second_id = e;
        }
      }
      group_score[g] = sigmoid ? first + second : first;
      group_kept[g] = false;
    }
    __syncwarp();
    for (int64_t round = 0; round < topk_group; ++round) {
      float best = NAN;
      int64_t best_id = -1;
      for (int64_t g = lane; g < n_group; g += 32) {
        if (!group_kept[g] && ahead(group_score[g], g, best, best_id)) {
          best = group_score[g];
          best_id = g;
        }
      }
      warp_best(best, best_id);
      if (lane == 0) group_kept[best_id] = true;
      __syncwarp();
    }
  }

  float* out_weights = weights + t * top_k;
  int64_t* out_ids = ids + t * top_k;
  for (int64_t j = 0; j < top_k; ++j) {
    float best = NAN;
    int64_t best_id = -1;
    for (int64_t e = lane; e < num_experts; e += 32) {
      if (!taken[e] && (n_group == 1 || group_kept[e / per_group]) &&
          ahead(choice[e], e, best, best_id)) {
        best = choice[e];
        best_id = e;
      }
    }
    warp_best(best, best_id);
    if (lane == 0) {
      taken[best_id] = true;
      out_ids[j] = best_id;
      out_weights[j] = scores[best_id];
    }
    __syncwarp();
  }
  if (lane == 0) {
    float total = 0.0f;
    for (int64_t j = 0; j < top_k; ++j) total += out_weights[j];
    for (int64_t j = 0; j < top_k; ++j) {
      if (renormalize) out_weights[j] /= total + 1e-20f;
      out_weights[j] *= routed_scaling_factor;
    }
  }
}

}  // namespace kvserve::cuda
