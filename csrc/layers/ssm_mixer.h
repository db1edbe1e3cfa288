#pragma once
// The state-space mixers a layer may hold in place of attention (or beside it): Mamba2's
// (mamba2_mixer.h) and Mamba's (mamba_mixer.h). Each reads and writes its sequences' fixed-size
// conv and SSM states in the layer's entry of the state pool.

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "kvserve/attention_metadata.h"
#include "kvserve/model_config.h"
#include "layers/linear.h"
#include "layers/weights.h"

namespace kvserve {

class SsmMixer {
 public:
  virtual ~SsmMixer() = default;

  /// hidden [T, hidden_size] -> [T, hidden_size] for the batch's sequences
  /// (metadata.query_start_loc), each continuing from the state in its slot
  /// (metadata.state_slots, when metadata.has_initial_state) and leaving its new state there.
  /// state: the layer's entry of the pool (key: conv states, value: SSM states).
  virtual at::Tensor forward(const at::Tensor& hidden, const AttentionMetadata& metadata,
                             const LayerKVCache& state) const = 0;

  virtual int64_t weight_bytes() const = 0;
};

/// The mixer config.ssm.kind names, its weights under `prefix`. Throws std::invalid_argument on
/// a missing or misshapen weight.
std::unique_ptr<SsmMixer> make_ssm_mixer(const ModelConfig& config, const std::string& prefix,
                                         const WeightMap& weights);

/// The mixers' weight checks: weight `name` contiguous, of `shape`; a projection's shape
/// [out_features, in_features]. Throw std::invalid_argument naming the weight otherwise.
at::Tensor ssm_weight(const WeightMap& weights, const std::string& name,
                      const std::vector<int64_t>& shape);
void check_linear_shape(const Linear& linear, const std::string& name, int64_t out_features,
                        int64_t in_features);

}  // namespace kvserve
