#pragma once
// Multi-head latent attention (DeepSeek-V2/V3). Every token caches one latent: the normalized
// compressed KV [kv_lora_rank] and the RoPE key [qk_rope_head_dim] shared by all heads, in a
// latent paged cache [num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]. A sequence is
// attended in one of two equivalent forms, chosen per sequence by arithmetic cost:
//  * absorbed: W_UK is folded into the query and W_UV into the output, so the attention itself
//    is multi-query attention over the latents (query and key of kv_lora_rank + rope, value of
//    kv_lora_rank) and the cache is never expanded. Per query token and head it costs
//    (2 kv_lora_rank + rope) multiply-adds per context token plus 2 kv_lora_rank x head_dim for
//    the two absorptions: cheap for decode.
//  * expanded: the context's latents are expanded by kv_b_proj to per-head keys and values
//    (one GEMM over the context, kv_lora_rank x heads x (nope + v) per context token) and plain
//    attention runs over them (nope + rope + v per query and context token): cheap for prefill,
//    where the expansion is shared by many queries.

#include <ATen/core/Tensor.h>

#include <string>
#include <utility>
#include <vector>

#include "kvserve/attention_metadata.h"
#include "kvserve/model_config.h"
#include "layers/linear.h"
#include "layers/norm.h"
#include "layers/rotary.h"
#include "layers/weights.h"

namespace kvserve {

/// Which form attends each sequence of one batch, and the metadata of each part; made once per
/// forward pass and shared by every MLA layer.
struct MLABatchPlan {
  /// A subset of the batch's sequences as paged_attention sees it.
  struct Part {
    at::Tensor token_index;      ///< int64 [T_part] rows of the batch; undefined = every row
    at::Tensor query_start_loc;  ///< int32 [B_part + 1]
    at::Tensor seq_lens;         ///< int32 [B_part]
    at::Tensor block_tables;     ///< int32 [B_part, *]: cache blocks (absorbed) or, expanded,
                                 ///< positions in `gather_blocks`
    at::Tensor gather_blocks;    ///< int64 [num_gathered] (expanded): the cache blocks to expand
    int64_t num_tokens = 0;
    bool empty() const { return num_tokens == 0; }
  };
  Part absorbed, expanded;

  /// Splits the batch by cost (see above); `path` forces one form: "auto", "absorbed" or
  /// "expanded". Throws std::invalid_argument on another path.
  static MLABatchPlan make(const AttentionMetadata& metadata, const MLAConfig& mla,
                           int64_t block_size, const std::string& path);
};

/// One layer's MLA. Weights (loader names under layers.<i>.self_attn.): q_proj.weight
/// [H * (nope + rope), hidden] without q_lora_rank, else q_a_proj.weight [q_lora_rank, hidden],
/// q_a_layernorm.weight, q_b_proj.weight [H * (nope + rope), q_lora_rank];
/// kv_a_proj_with_mqa.weight [kv_lora_rank + rope, hidden], kv_a_layernorm.weight,
/// kv_b_proj.weight [H * (nope + v), kv_lora_rank], o_proj.weight [hidden, H * v]; optional
/// biases of q_a_proj, kv_a_proj_with_mqa and o_proj (attention_bias).
class MLAAttention {
 public:
  MLAAttention(const ModelConfig& config, int64_t layer, const WeightMap& weights,
               const RotaryEmbedding* rotary, double scale);

  /// hidden [T, hidden_size] -> [T, hidden_size]; writes this step's latents into kv_cache (key
  /// and value both the latent cache) first.
  at::Tensor forward(const at::Tensor& positions, const at::Tensor& hidden,
                     const AttentionMetadata& metadata, const LayerKVCache& kv_cache,
                     const MLABatchPlan& plan) const;

  int64_t weight_bytes() const;

  /// No LoRA on latent attention (adapters may still target the layer's dense MLP).
  std::vector<LoraLinear> lora_linears() { return {}; }

 private:
  // out [T_part, H, v] of the part's queries (q_nope [T_part, H, nope], q_rope [T_part, H, rope]).
  at::Tensor attend_absorbed(const at::Tensor& q_nope, const at::Tensor& q_rope,
                             const LayerKVCache& kv, const MLABatchPlan::Part& part) const;
  at::Tensor attend_expanded(const at::Tensor& q_nope, const at::Tensor& q_rope,
                             const LayerKVCache& kv, const MLABatchPlan::Part& part) const;

  MLAConfig mla_;
  int64_t num_heads_;
  double scale_;
  const RotaryEmbedding* rotary_;
  Linear q_proj_;          // hidden -> q (no q_lora_rank)
  Linear q_a_kv_a_proj_;   // hidden -> [q_a (q_lora_rank) | latent | k_rope]; without q_lora_rank
                           // just [latent | k_rope]
  RMSNorm q_a_layernorm_;
  Linear q_b_proj_;        // q_a -> q; output rows reordered: every head's nope, then every rope
  RMSNorm kv_a_layernorm_;
  // kv_b_proj's halves per head: absorbed, W_UK maps q_nope into latent space and W_UV the
  // attended latent to values; expanded, they map latents to keys and values.
  at::Tensor w_uk_;        // fp32 [H, nope, kv_lora_rank]
  at::Tensor w_uv_;        // fp32 [H, v, kv_lora_rank]
  Linear o_proj_;
};

}  // namespace kvserve
