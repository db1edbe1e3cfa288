#pragma once
// The interface every model family implements. Models see one flattened batch and its attention
// metadata, never requests.

#include <ATen/core/Tensor.h>

#include <vector>

#include "kvserve/attention_metadata.h"
#include "kvserve/model_config.h"

namespace kvserve {

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

  virtual const ModelConfig& config() const = 0;

  /// dtype of the weights, activations and KV cache.
  virtual at::ScalarType dtype() const = 0;

  /// Device the weights live on; inputs and caches must be there too.
  virtual at::Device device() const = 0;

  /// Bytes of all weights (what one decode step reads at least once).
  virtual int64_t weight_bytes() const = 0;
};

}  // namespace kvserve
