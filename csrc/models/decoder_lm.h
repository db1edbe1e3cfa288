#pragma once
// What the pre-norm decoder families share: the token embedding (or the rows of a tied, packed LM
// head), the residual stream through each layer's RMSNorms (two, or four with Gemma's sandwich
// norms), attention and MLP, the final norm and the LM head. A family supplies its attention
// layer type and builds its layers. Split over tensor-parallel ranks (the weights'
// communicator), the embedding and the LM head are vocabulary-parallel: each rank holds
// ceil(vocab / ranks) rows (the last rank's padded with zeros), looks up the ids it holds and
// sums the ranks' rows, and its logits are gathered from every rank's columns.

#include <ATen/ops/cat.h>
#include <ATen/ops/embedding.h>
#include <ATen/ops/scalar_tensor.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "kvserve/causal_lm.h"
#include "layers/feed_forward.h"
#include "layers/linear.h"
#include "layers/ssm_mixer.h"
#include "layers/mlp.h"
#include "layers/moe.h"
#include "layers/norm.h"
#include "layers/weights.h"

namespace kvserve {

/// embed -> L x (norm, attention, residual, norm, MLP, residual) -> norm. Weights (loader names):
/// embed_tokens.weight [vocab, hidden], norm.weight, lm_head.weight (or lm_head.qweight, .scales,
/// .zeros: quantized) unless tied, and per layer
/// input_layernorm.weight, post_attention_layernorm.weight, the attention's and the MLP's
/// (GatedMLP under layers.<i>.mlp., or SparseMoE on the config's MoE layers). With the config's
/// sandwich_norms (Gemma 2/3) a layer is norm, attention, norm (post_attention_layernorm),
/// residual, norm (pre_feedforward_layernorm), MLP, norm (post_feedforward_layernorm), residual;
/// with parallel_block (Cohere) it is norm, then attention and MLP on the same normed input,
/// both added to the residual. Norms are RMSNorms, or LayerNorms (config.norm_type).
/// The config's embedding_multiplier, norm_weight_offset, hidden_act and final_logit_softcap
/// apply throughout.
template <typename AttentionLayer>
class DecoderLM : public CausalLM {
 public:
  /// Every rank of a tensor-parallel model calls this on the same rows: each computes its
  /// vocabulary columns, and every rank gets all of them.
  at::Tensor compute_logits(const at::Tensor& hidden) override {
    at::Tensor logits = lm_head_.forward(hidden).to(at::kFloat);
    if (vocab_parallel_) {
      logits = vocab_parallel_->all_gather(logits, 1).narrow(1, 0, config_.vocab_size);
    }
    if (config_.logits_scaling != 1.0) logits.div_(config_.logits_scaling);  // Granite
    if (config_.final_logit_softcap > 0) {  // c * tanh(logits / c), as Gemma 2 does
      logits.div_(config_.final_logit_softcap).tanh_().mul_(config_.final_logit_softcap);
    }
    return logits;
  }
  at::Tensor embed_inputs(const at::Tensor& input_ids) const override {
    TORCH_CHECK(input_ids.dim() == 1, "forward: input_ids must be [T]");
    at::Tensor hidden = embed(input_ids);       // [T, hidden]
    if (config_.embedding_multiplier != 1.0) {  // the multiplier rounded to the dtype first
      hidden = hidden * at::scalar_tensor(config_.embedding_multiplier, hidden.options());
    }
    return hidden;
  }
  void capture_hidden_states(const std::vector<int64_t>& layers) override {
    for (int64_t layer : layers) {
      if (layer < 0 || layer > config_.num_layers) {
        throw std::invalid_argument("capture_hidden_states: layer " + std::to_string(layer) +
                                    " is outside [0, " + std::to_string(config_.num_layers) +
                                    "]");
      }
    }
    capture_layers_ = layers;
    captured_ = at::Tensor();
  }
  at::Tensor captured_hidden_states() const override { return captured_; }
  const ModelConfig& config() const override { return config_; }
  at::ScalarType dtype() const override { return dtype_; }
  at::Device device() const override { return device_; }
  std::shared_ptr<Communicator> ranks() const override { return vocab_parallel_; }

  std::vector<LoraTarget> lora_targets() override {
    std::vector<LoraTarget> targets;
    for (const LoraLinear& l : lora_linears()) {
      targets.push_back({l.name, l.linear->in_features(), l.linear->out_features(),
                         lora_rank_ * l.parts});
    }
    return targets;
  }
  void enable_lora(int64_t slots, int64_t rank) override {
    const auto linears = lora_linears();
    if (linears.empty()) throw std::invalid_argument("this model has no projection for LoRA");
    for (const LoraLinear& l : linears) {
      l.linear->enable_lora(slots, rank * l.parts, dtype_, device_);
    }
    lora_slots_ = slots;
    lora_rank_ = rank;
  }
  int64_t num_lora_slots() const override { return lora_slots_; }
  void set_lora(int64_t slot, const LoraFactors& factors) override {
    if (lora_slots_ == 0) throw std::invalid_argument("LoRA is not enabled");
    const auto linears = lora_linears();
    for (const auto& [name, pair] : factors) {
      const bool known = std::any_of(linears.begin(), linears.end(),
                                     [&](const LoraLinear& l) { return l.name == name; });
      if (!known) throw std::invalid_argument("no LoRA target named " + name);
    }
    // Every factor checked before any is written: a bad one leaves the slot as it was.
    for (const LoraLinear& l : linears) {
      auto it = factors.find(l.name);
      if (it != factors.end()) l.linear->check_lora(slot, it->second.first, it->second.second);
    }
    for (const LoraLinear& l : linears) {
      auto it = factors.find(l.name);
      if (it == factors.end()) {
        l.linear->clear_lora(slot);
      } else {
        l.linear->set_lora(slot, it->second.first, it->second.second);
      }
    }
  }
  void clear_lora(int64_t slot) override {
    if (lora_slots_ == 0) throw std::invalid_argument("LoRA is not enabled");
    for (const LoraLinear& l : lora_linears()) l.linear->clear_lora(slot);
  }

  int64_t embedding_bytes() const override {
    if (config_.tie_word_embeddings) return 0;
    return embed_tokens_.defined() ? embed_tokens_.nbytes() : embedding_.weight_bytes();
  }

  int64_t weight_bytes() const override {
    // A tied LM head shares the embedding matrix (or holds it alone, packed).
    int64_t bytes = norm_.weight_bytes() + lm_head_.weight_bytes() + embedding_bytes();
    for (const Layer& layer : layers_) {
      bytes += layer.input_norm.weight_bytes() + layer.attention_out_norm.weight_bytes() +
               layer.mlp_norm.weight_bytes() + layer.mlp_out_norm.weight_bytes();
      if (layer.self_attn) bytes += layer.self_attn->weight_bytes();
      if (layer.mixer) bytes += layer.mixer->weight_bytes();
      if (layer.mlp) bytes += layer.mlp->weight_bytes();
    }
    return bytes;
  }

 protected:
  struct Layer {
    Norm input_norm;  // before attention (none with post_norms)
    std::unique_ptr<AttentionLayer> self_attn;  // null in a state-space layer or an MLP alone
    std::unique_ptr<SsmMixer> mixer;            // null in an attention layer or an MLP alone
    Norm attention_out_norm;  // sandwich or post norms only
    Norm mlp_norm;            // before the MLP (none with post_norms or a parallel block)
    std::unique_ptr<FeedForward> mlp;
    Norm mlp_out_norm;  // sandwich or post norms only
  };

  /// Reads the embedding; the family's constructor then adds its layers with add_layer() and
  /// calls finish(). Throws std::invalid_argument on a missing weight or inconsistent config.
  DecoderLM(const ModelConfig& config, const WeightMap& w)
      : config_(config),
        embed_tokens_(w.get_optional("embed_tokens.weight")),
        embedding_(embed_tokens_.defined() ? Linear() : Linear::load(w, "embed_tokens")),
        dtype_(embed_tokens_.defined() ? embed_tokens_.scalar_type()
                                       : w.get("norm.weight").scalar_type()),
        device_(embed_tokens_.defined() ? embed_tokens_.device()
                                        : w.get("norm.weight").device()) {
    config_.validate();
    const std::shared_ptr<Communicator>& ranks = w.communicator();
    if (ranks->size() > 1) {
      vocab_parallel_ = ranks;
      vocab_rows_ = (config_.vocab_size + ranks->size() - 1) / ranks->size();
      vocab_start_ = ranks->rank() * vocab_rows_;
    } else {
      vocab_rows_ = config_.vocab_size;
    }
    const bool shape_ok = embed_tokens_.defined()
                              ? embed_tokens_.dim() == 2 && embed_tokens_.size(0) == vocab_rows_ &&
                                    embed_tokens_.size(1) == config_.hidden_size
                              : embedding_.out_features() == vocab_rows_ &&
                                    embedding_.in_features() == config_.hidden_size;
    TORCH_CHECK(shape_ok, "embed_tokens must be [", vocab_rows_, ", ", config_.hidden_size, "] (",
                vocab_parallel_ ? "this rank's rows of " : "", "a vocabulary of ",
                config_.vocab_size, "), got ",
                embed_tokens_.defined()
                    ? embed_tokens_.sizes().vec()
                    : std::vector<int64_t>{embedding_.out_features(), embedding_.in_features()});
    layers_.reserve(config_.num_layers);
    for (int64_t i = 0; i < config_.num_layers; ++i) {
      cache_index_.push_back(config_.kv_cache_index(i));
      state_index_.push_back(config_.state_cache_index(i));
    }
  }

  /// Layer `i` with this attention, a state-space mixer (layers.<i>.mixer.) when it has a
  /// state-space mixer (config.ssm; attention null unless the layer has both, FalconH1's
  /// parallel form), its norms and its MLP (dense or MoE; none when config.ssm.mlp is false)
  /// from the weights. A layer that is an MLP alone (ModelConfig::mlp_only) has its input norm
  /// and its MLP only.
  void add_layer(int64_t i, std::unique_ptr<AttentionLayer> attention, const WeightMap& w) {
    const std::string p = "layers." + std::to_string(i) + ".";
    Layer layer;
    if (!config_.post_norms) layer.input_norm = norm(w, p + "input_layernorm.weight");
    if (config_.mlp_only(i)) {
      layer.mlp = feed_forward(i, p + "mlp.", w);
      layers_.push_back(std::move(layer));
      return;
    }
    if (config_.has_mixer(i)) {
      layer.mixer = make_ssm_mixer(config_, p + "mixer.", w);
    }
    layer.self_attn = std::move(attention);
    if (!config_.ssm.mlp) {
      layers_.push_back(std::move(layer));
      return;
    }
    if (config_.sandwich_norms || config_.post_norms) {
      layer.attention_out_norm = norm(w, p + "post_attention_layernorm.weight");
      if (config_.sandwich_norms) layer.mlp_norm = norm(w, p + "pre_feedforward_layernorm.weight");
      layer.mlp_out_norm = norm(w, p + "post_feedforward_layernorm.weight");
    } else if (!config_.parallel_block) {
      layer.mlp_norm = norm(w, p + "post_attention_layernorm.weight");
    }
    layer.mlp = feed_forward(i, p + "mlp.", w);
    layers_.push_back(std::move(layer));
  }

  /// Layer `i`'s MLP under `prefix`: its mixture of experts, or its dense MLP, gated or not.
  std::unique_ptr<FeedForward> feed_forward(int64_t i, const std::string& prefix,
                                            const WeightMap& w) const {
    if (config_.is_moe_layer(i)) return std::make_unique<SparseMoE>(config_.moe, prefix, w);
    if (!config_.gated_mlp) return std::make_unique<UngatedMLP>(prefix, w, config_.hidden_act);
    return std::make_unique<GatedMLP>(prefix, w, config_.hidden_act);
  }

  /// The norm of weight `name`: an RMSNorm with the config's epsilon and weight offset, or a
  /// LayerNorm without a bias (config.norm_type; Cohere's).
  Norm norm(const WeightMap& w, const std::string& name) const {
    if (config_.norm_type == "layer_norm") {
      return LayerNorm(w.get(name), at::Tensor(), config_.rms_norm_eps);
    }
    return RMSNorm(w.get(name), config_.rms_norm_eps, config_.norm_weight_offset);
  }

  /// The final norm and the LM head, after the layers.
  void finish(const WeightMap& w) {
    norm_ = norm(w, "norm.weight");
    // An untied head may be quantized (lm_head.qweight: `kvserve quantize --lm-head`); a tied
    // one is the embedding, quantized or not (`--embeddings`).
    lm_head_ = !config_.tie_word_embeddings ? Linear::load(w, "lm_head")
               : embedding_.defined()       ? embedding_
                                            : Linear(embed_tokens_, at::Tensor());
    // A tied embedding reads its rows from the LM head's (packed) weight: one copy of the matrix.
    if (config_.tie_word_embeddings && lm_head_.packed()) embed_tokens_ = at::Tensor();
  }

  /// The residual stream from the first layer's inputs [T, hidden] (embed_inputs(ids), or a
  /// multi-token-prediction block's): attend(i, attention, normed hidden [T, hidden],
  /// cache) runs layer i's attention on the cache it reads (its own, or the one of the layer
  /// whose KV it shares); a state-space layer's mixer runs on its state instead (or beside it,
  /// the two outputs summed). kv_caches: one per layer that writes K/V, then one per
  /// state-space layer (ModelConfig::kv_cache_index, state_cache_index);
  /// metadata.lora_slots: the tokens' adapter slots for the MLPs. Returns the final-norm hidden
  /// states [T, hidden].
  template <typename Attend>
  at::Tensor run_layers(at::Tensor hidden, const at::Tensor& positions,
                        const std::vector<LayerKVCache>& kv_caches,
                        const AttentionMetadata& metadata, Attend&& attend) const {
    const int64_t num_caches = config_.num_kv_layers() + config_.num_ssm_layers();
    TORCH_CHECK(static_cast<int64_t>(kv_caches.size()) == num_caches, "forward: got ",
                kv_caches.size(), " caches for ", config_.num_kv_layers(),
                " layers that write K/V and ", config_.num_ssm_layers(), " state-space layers");
    const at::Tensor& lora_slots = metadata.lora_slots;
    TORCH_CHECK(hidden.dim() == 2 && hidden.size(1) == config_.hidden_size &&
                    positions.dim() == 1 && positions.size(0) == hidden.size(0),
                "forward: input_ids and positions must both be [T] (inputs [T, ",
                config_.hidden_size, "])");
    TORCH_CHECK(hidden.scalar_type() == dtype_ && hidden.device() == device_,
                "forward: inputs must be ", dtype_, " on ", device_);
    if (layers_.empty()) return norm_.forward(hidden);
    // The residual streams capture_hidden_states asked for, copied as they pass.
    std::vector<at::Tensor> kept(capture_layers_.size());
    const auto keep = [&](int64_t layer, const at::Tensor& stream) {
      for (size_t k = 0; k < capture_layers_.size(); ++k) {
        if (capture_layers_[k] == layer) kept[k] = stream.clone();
      }
    };
    at::Tensor residual;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      if (i == 0) {
        residual = hidden;
        if (!kept.empty()) keep(0, residual);
        if (layer.input_norm.defined()) hidden = layer.input_norm.forward(residual);
      } else {
        add_then_norm(layer.input_norm, hidden, residual);
        if (!kept.empty()) keep(static_cast<int64_t>(i), residual);
      }
      if (!layer.mixer && !layer.self_attn) {  // an MLP alone, on the input norm's output
        hidden = layer.mlp->forward(hidden, lora_slots);
        scale_residual(hidden);
        continue;
      }
      at::Tensor mixed;  // the mixer's output, the attention's, or (FalconH1) their sum
      if (layer.mixer) mixed = layer.mixer->forward(hidden, metadata, kv_caches[state_index_[i]]);
      if (layer.self_attn) {
        at::Tensor attended = attend(i, *layer.self_attn, hidden, kv_caches[cache_index_[i]]);
        mixed = mixed.defined() ? mixed.add_(attended) : std::move(attended);
      }
      if (config_.parallel_block) {  // Cohere: the MLP reads the attention's input too
        at::Tensor mlp_out = layer.mlp->forward(hidden, lora_slots);
        residual.add_(mixed);       // residual + attention, then + MLP in the next norm:
        hidden = std::move(mlp_out);  // the reference's order of additions
        continue;
      }
      hidden = std::move(mixed);
      if (layer.attention_out_norm.defined()) hidden = layer.attention_out_norm.forward(hidden);
      scale_residual(hidden);
      if (!layer.mlp) continue;  // the next norm adds the mixer's output to the residual
      add_then_norm(layer.mlp_norm, hidden, residual);
      hidden = layer.mlp->forward(hidden, lora_slots);
      if (layer.mlp_out_norm.defined()) hidden = layer.mlp_out_norm.forward(hidden);
      scale_residual(hidden);
    }
    norm_.forward_fused(hidden, residual);
    if (!kept.empty()) {
      keep(static_cast<int64_t>(layers_.size()), residual);
      captured_ = at::cat(kept, 1);
    }
    return hidden;
  }

  /// residual += hidden; hidden = norm(residual), or (no norm before the next block: OLMo 2's
  /// post-norm layers) the residual itself, which the block reads without writing.
  static void add_then_norm(const Norm& norm, at::Tensor& hidden, at::Tensor& residual) {
    if (norm.defined()) {
      norm.forward_fused(hidden, residual);
    } else {
      residual.add_(hidden);
      hidden = residual;
    }
  }

  /// A layer's output as it joins the residual stream (Granite's residual_multiplier: a double
  /// multiplier, each product rounded to the dtype, as the reference's Python float does).
  void scale_residual(at::Tensor& hidden) const {
    if (config_.residual_multiplier != 1.0) hidden.mul_(config_.residual_multiplier);
  }

  /// The embedding rows of input_ids: looked up alone, or over vocabulary-parallel ranks each
  /// rank's rows of the ids it holds (zeros for the others), summed over the ranks.
  at::Tensor embed(const at::Tensor& input_ids) const {
    const auto lookup = [&](const at::Tensor& ids) {
      if (embed_tokens_.defined()) return at::embedding(embed_tokens_, ids);
      return (embedding_.defined() ? embedding_ : lm_head_).rows(ids, dtype_);
    };
    if (!vocab_parallel_) return lookup(input_ids);
    const at::Tensor local = input_ids - vocab_start_;
    const at::Tensor held = local.ge(0).logical_and(local.lt(vocab_rows_));
    at::Tensor rows = lookup(local.clamp(0, vocab_rows_ - 1)) * held.unsqueeze(1).to(dtype_);
    vocab_parallel_->all_reduce_(rows);
    return rows;
  }

  /// Every projection that can serve LoRA adapters, named as the loader names its weight.
  std::vector<LoraLinear> lora_linears() {
    std::vector<LoraLinear> out;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const std::string p = "layers." + std::to_string(i) + ".";
      if (layers_[i].self_attn) {
        for (LoraLinear l : layers_[i].self_attn->lora_linears()) {
          l.name = p + "self_attn." + l.name;
          out.push_back(l);
        }
      }
      if (!layers_[i].mlp) continue;
      for (LoraLinear l : layers_[i].mlp->lora_linears()) {
        l.name = p + "mlp." + l.name;
        out.push_back(l);
      }
    }
    return out;
  }

  ModelConfig config_;
  int64_t lora_slots_ = 0;  // LoRA adapters each target projection holds
  int64_t lora_rank_ = 0;   // their rank per unfused projection
  at::Tensor embed_tokens_;  // [vocab rows, hidden]; undefined when tied to a packed lm_head_
  Linear embedding_;  // or a quantized embedding (embed_tokens.qweight), its rows dequantized
  std::shared_ptr<Communicator> vocab_parallel_;  // null: the whole vocabulary on this rank
  int64_t vocab_start_ = 0;                       // the first id of this rank's rows
  int64_t vocab_rows_ = 0;  // rows of the embedding and the LM head on this rank
  at::ScalarType dtype_;
  at::Device device_;
  std::vector<Layer> layers_;
  std::vector<int64_t> cache_index_;  // per layer: which of the forward's kv_caches it attends over
  std::vector<int64_t> state_index_;  // per layer: which holds its mixer's state (if it has one)
  std::vector<int64_t> capture_layers_;  // the streams a forward keeps (capture_hidden_states)
  mutable at::Tensor captured_;          // the last forward's
  Norm norm_;
  Linear lm_head_;
};

}  // namespace kvserve
