#pragma once
// The interface every model family implements. Models see one flattened batch and its attention
// metadata, never requests.

#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kvserve/attention_metadata.h"
#include "kvserve/communicator.h"
#include "kvserve/model_config.h"

namespace kvserve {

/// A projection that can serve LoRA adapters: its name in the model (as the loader names
/// weights, e.g. layers.0.self_attn.qkv_proj) and its shape.
struct LoraTarget {
  std::string name;
  int64_t in_features = 0, out_features = 0;
  int64_t rank = 0;  ///< rows an adapter's factors may have (once enabled; fused parts add up)
};

/// Per projection name, the factors a [r, in_features] and b [r, out_features] (B transposed,
/// the scaling included) of one adapter.
using LoraFactors = std::map<std::string, std::pair<at::Tensor, at::Tensor>>;

/// A decoder-only language model.
class CausalLM {
 public:
  virtual ~CausalLM() = default;

  /// Runs all layers over input_ids [T] (int64) at positions [T] (int64), writing each token's
  /// K/V to kv_caches (one per layer) at metadata.slot_mapping. Returns the final-norm hidden
  /// states [T, hidden_size] in the model dtype.
  virtual at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& positions,
                             const AttentionMetadata& metadata,
                             const std::vector<LayerKVCache>& kv_caches) = 0;

  /// Logits for hidden states [N, hidden_size]: fp32 [N, vocab_size].
  virtual at::Tensor compute_logits(const at::Tensor& hidden) = 0;

  /// What forward() feeds its first layer for input_ids [T]: the token embeddings (times the
  /// config's embedding_multiplier), [T, hidden_size] in the model dtype.
  virtual at::Tensor embed_inputs(const at::Tensor& input_ids) const {
    throw std::invalid_argument("this model has no token embedding to share");
  }

  /// From the next forward on, keeps the residual stream entering each of `layers` (0: the
  /// embeddings; num_layers: the stream after the last layer, before the final norm), what an
  /// EAGLE-3 head reads of the target. Empty: nothing is kept (the default, and free). Throws
  /// std::invalid_argument for a layer outside [0, num_layers] or a model that cannot.
  virtual void capture_hidden_states(const std::vector<int64_t>& layers) {
    throw std::invalid_argument("this model cannot keep its hidden states");
  }
  /// The last forward's kept streams side by side: [T, layers * hidden_size] in the model
  /// dtype; undefined when none are kept.
  virtual at::Tensor captured_hidden_states() const { return at::Tensor(); }

  /// forward() from first-layer inputs [T, hidden_size] given in place of embed_inputs(ids): a
  /// multi-token-prediction block's input, its projection of an embedding and a hidden state.
  virtual at::Tensor forward_embeds(const at::Tensor& inputs, const at::Tensor& positions,
                                    const AttentionMetadata& metadata,
                                    const std::vector<LayerKVCache>& kv_caches) {
    throw std::invalid_argument("this model runs from token ids only");
  }

  virtual const ModelConfig& config() const = 0;

  /// dtype of the weights, activations and KV cache.
  virtual at::ScalarType dtype() const = 0;

  /// Device the weights live on; inputs and caches must be there too.
  virtual at::Device device() const = 0;

  /// Bytes of all weights (what one decode step reads at least once).
  virtual int64_t weight_bytes() const = 0;
  /// The part of weight_bytes() that is the input embedding held apart from the LM head (0 when
  /// the two are tied): a decode step reads one row of it a token, and every byte of the rest.
  virtual int64_t embedding_bytes() const { return 0; }

  /// The device group of a model split over ranks (tensor parallelism): where its shards meet in
  /// the forward's collectives, and where other tensors of a step go between its ranks. Null
  /// for a model held whole by one rank.
  virtual std::shared_ptr<Communicator> ranks() const { return nullptr; }

  // LoRA adapters served without merging: every target projection holds `slots` adapters of rank
  // up to `rank`; a token runs with the adapter of its slot (AttentionMetadata::lora_slots).
  // Models without targets throw std::invalid_argument from enable_lora.
  virtual std::vector<LoraTarget> lora_targets() { return {}; }
  virtual void enable_lora(int64_t slots, int64_t rank) {
    throw std::invalid_argument("this model serves no LoRA adapters");
  }
  virtual int64_t num_lora_slots() const { return 0; }
  bool lora_enabled() const { return num_lora_slots() > 0; }
  /// Loads one adapter into `slot`; target projections it does not name add nothing. Throws
  /// std::invalid_argument for a name that is not a target, c10::Error for a bad shape.
  virtual void set_lora(int64_t slot, const LoraFactors& factors) {
    throw std::invalid_argument("LoRA is not enabled");
  }
  virtual void clear_lora(int64_t slot) { throw std::invalid_argument("LoRA is not enabled"); }
};

}  // namespace kvserve
