#include "models/eagle3_head.h"

#include <ATen/ops/any.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/embedding.h>
#include <ATen/ops/full.h>

#include <limits>
#include <stdexcept>
#include <string>

namespace kvserve {

namespace {

void require(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument("Eagle3Head: " + message);
}

}  // namespace

Eagle3Head::Eagle3Head(ModelConfig config, std::shared_ptr<CausalLM> target,
                       const WeightMap& w, int64_t max_positions, bool norm_before_residual)
    : DraftHead(std::move(target)),
      config_(std::move(config)),
      norm_before_residual_(norm_before_residual) {
  config_.validate();
  require(config_.num_layers == 1, "the head is one decoder layer");
  require(config_.vocab_size == target_->config().vocab_size,
          "its vocabulary (" + std::to_string(config_.vocab_size) + ") is not the target's (" +
              std::to_string(target_->config().vocab_size) + ")");
  const int64_t hidden = config_.hidden_size;
  const double eps = config_.rms_norm_eps;
  fc_ = Linear::load(w, "fc");
  require(fc_.out_features() == hidden && fc_.in_features() % target_->config().hidden_size == 0,
          "fc must be [" + std::to_string(hidden) + ", streams * " +
              std::to_string(target_->config().hidden_size) + "]");
  embed_tokens_ = w.get_optional("embed_tokens.weight");
  require(embed_tokens_.defined() || target_->config().hidden_size == hidden,
          "a head whose hidden size differs from the target's needs its own embed_tokens");
  input_norm_ = RMSNorm(w.get("layers.0.input_layernorm.weight"), eps);
  hidden_norm_ = RMSNorm(w.get("layers.0.hidden_norm.weight"), eps);
  post_attention_norm_ = RMSNorm(w.get("layers.0.post_attention_layernorm.weight"), eps);
  norm_ = RMSNorm(w.get("norm.weight"), eps);
  if (!config_.no_rope) {
    rotary_ = RotaryEmbedding(config_, max_positions, target_->device(), !config_.rope_interleave);
  }
  attention_ = std::make_unique<Attention>(config_, 0, w, config_.no_rope ? nullptr : &rotary_);
  mlp_ = std::make_unique<GatedMLP>("layers.0.mlp.", w, config_.hidden_act);
  lm_head_ = Linear::load(w, "lm_head");
  require(lm_head_.in_features() == hidden, "lm_head must read the hidden size");
  const at::Tensor d2t = w.get("d2t");
  require(d2t.dim() == 1 && d2t.size(0) == lm_head_.out_features(),
          "d2t must have one entry per draft token (" + std::to_string(lm_head_.out_features()) +
              ")");
  target_ids_ = (at::arange(d2t.size(0), d2t.options().dtype(at::kLong)) + d2t.to(at::kLong))
                    .to(target_->device());
  const int64_t low = target_ids_.min().item<int64_t>(), high = target_ids_.max().item<int64_t>();
  require(low >= 0 && high < config_.vocab_size,
          "d2t maps draft tokens outside the target's vocabulary");
  // A head over the whole vocabulary in the target's order (d2t all zero) needs no scatter.
  whole_vocabulary_ = d2t.size(0) == config_.vocab_size && !d2t.any().item<bool>();
}

at::Tensor Eagle3Head::target_states(const at::Tensor& hidden) {
  const at::Tensor captured = target_->captured_hidden_states();
  TORCH_CHECK(captured.defined() && captured.size(0) == hidden.size(0),
              "Eagle3Head: the target kept no hidden states of its last forward "
              "(capture_hidden_states; CUDA graphs do not keep them)");
  return fc_.forward(captured);
}

DraftHead::Output Eagle3Head::forward_depth(int64_t depth, const at::Tensor& input_ids,
                                            const at::Tensor& previous,
                                            const at::Tensor& positions,
                                            const AttentionMetadata& metadata,
                                            const std::vector<LayerKVCache>& kv_caches) {
  TORCH_CHECK(depth == 0, "Eagle3Head: one depth, got ", depth);
  TORCH_CHECK(kv_caches.size() == 1, "Eagle3Head: one cache, got ", kv_caches.size());
  const at::Tensor embedded = embed_tokens_.defined() ? at::embedding(embed_tokens_, input_ids)
                                                      : target_->embed_inputs(input_ids);
  at::Tensor normed = hidden_norm_.forward(previous);
  at::Tensor residual = norm_before_residual_ ? normed.clone() : previous.clone();
  at::Tensor x = attention_->forward(
      positions, at::cat({input_norm_.forward(embedded), normed}, 1), metadata, kv_caches[0]);
  post_attention_norm_.forward_fused(x, residual);  // residual += attention; x = norm(residual)
  x = mlp_->forward(x);
  norm_.forward_fused(x, residual);  // residual += MLP (the next input); x = norm(residual)
  return {x, residual};
}

at::Tensor Eagle3Head::compute_logits(const at::Tensor& hidden) {
  const at::Tensor draft = lm_head_.forward(hidden).to(at::kFloat);
  if (whole_vocabulary_) return draft;
  at::Tensor logits = at::full({hidden.size(0), config_.vocab_size},
                               -std::numeric_limits<float>::infinity(), draft.options());
  logits.index_copy_(1, target_ids_, draft);
  return logits;
}

int64_t Eagle3Head::weight_bytes() const {
  return fc_.weight_bytes() + (embed_tokens_.defined() ? embed_tokens_.nbytes() : 0) +
         input_norm_.weight_bytes() + hidden_norm_.weight_bytes() +
         post_attention_norm_.weight_bytes() + norm_.weight_bytes() +
         attention_->weight_bytes() + mlp_->weight_bytes() + lm_head_.weight_bytes();
}

}  // namespace kvserve
