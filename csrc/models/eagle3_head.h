#pragma once
// EAGLE-3 heads (Li et al., "EAGLE-3: Scaling up Inference Acceleration of Large Language Models
// via Training-Time Test", 2025), in the layout of the published heads: one Llama decoder layer
// whose attention reads the normed token embedding beside the normed previous hidden state (its
// q/k/v projections take 2 * hidden inputs), fed first with `fc` of three of the target's
// residual streams (low, middle and high layers: CausalLM::capture_hidden_states) and after with
// its own output before the final norm; its LM head covers a reduced draft vocabulary whose ids
// map to the target's through d2t (target id = draft id + d2t[draft id]).

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

#include "layers/attention.h"
#include "layers/linear.h"
#include "layers/mlp.h"
#include "layers/norm.h"
#include "layers/rotary.h"
#include "layers/weights.h"
#include "models/draft_head.h"

namespace kvserve {

class Eagle3Head : public DraftHead {
 public:
  /// config: the head's decoder layer as a one-layer Llama (its hidden size, heads and RoPE;
  /// vocab_size the target's). target: its captured streams feed depth 0, its embedding is read
  /// unless the head has its own, its vocabulary is the drafts'. Weights (loader names):
  /// fc.weight [hidden, streams * target hidden], layers.0.{input_layernorm, hidden_norm,
  /// post_attention_layernorm}.weight, layers.0.self_attn.{qkv_proj [.., 2 * hidden], o_proj},
  /// layers.0.mlp.{gate_up_proj, down_proj}, norm.weight, lm_head.weight [draft vocab, hidden],
  /// d2t [draft vocab], optionally embed_tokens.weight. norm_before_residual: the residual is the
  /// normed previous state (some heads' variant) rather than the state itself. Throws
  /// std::invalid_argument on a shape that does not fit.
  Eagle3Head(ModelConfig config, std::shared_ptr<CausalLM> target, const WeightMap& weights,
             int64_t max_positions, bool norm_before_residual = false);

  int64_t num_depths() const override { return 1; }
  /// fc of the target's captured streams, [T, hidden].
  at::Tensor target_states(const at::Tensor& hidden) override;
  /// for_logits: the layer's output after the final norm; for_next: before it.
  Output forward_depth(int64_t depth, const at::Tensor& input_ids, const at::Tensor& previous,
                       const at::Tensor& positions, const AttentionMetadata& metadata,
                       const std::vector<LayerKVCache>& kv_caches) override;
  /// Over the target's vocabulary: the draft vocabulary's logits at their target ids, -inf at
  /// every other id (a draft never proposes them). fp32 [N, vocab_size].
  at::Tensor compute_logits(const at::Tensor& hidden) override;
  const ModelConfig& config() const override { return config_; }
  int64_t weight_bytes() const override;

 private:
  ModelConfig config_;
  bool norm_before_residual_ = false;
  Linear fc_;
  at::Tensor embed_tokens_;  // undefined: the target's
  RMSNorm input_norm_, hidden_norm_, post_attention_norm_, norm_;
  RotaryEmbedding rotary_;
  std::unique_ptr<Attention> attention_;
  std::unique_ptr<GatedMLP> mlp_;
  Linear lm_head_;
  at::Tensor target_ids_;  // int64 [draft vocab]: each draft id's target id
  bool whole_vocabulary_ = false;  // target_ids_ is 0, 1, ..., vocab_size - 1
};

}  // namespace kvserve
