#pragma once
// Mamba2's state-space mixer (Dao & Gu, "Transformers are SSMs", 2024), the layer that replaces
// attention in Mamba2 and in the SSM layers of hybrids: one input projection, a short causal
// convolution, the selective scan and a gated RMSNorm, each sequence carrying a fixed-size conv
// and SSM state from one step to the next in its slot of the state pool.

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>

#include "kvserve/attention_metadata.h"
#include "kvserve/model_config.h"
#include "layers/linear.h"
#include "layers/ssm_mixer.h"
#include "layers/weights.h"

namespace kvserve {

/// One layer's mixer (config.ssm). Weights under `prefix`: in_proj.weight [2 * inner + 2 * G * N
/// + H, hidden] (gate z, then x, B and C, then dt; + bias with ssm.proj_bias), conv1d.weight
/// [conv_dim, kernel] (+ conv1d.bias), dt_bias [H], A_log [H] (A = -exp(A_log)), D [H],
/// norm.weight [inner] (none when ssm.norm is gate_only), out_proj.weight [hidden, inner]
/// (+ bias with ssm.out_proj_bias). Split over tensor-parallel ranks (the weights a rank's, the
/// config its heads and groups: kvserve/loader/sharding.py), out_proj sums the ranks' outputs,
/// and a gated norm with ssm.norm_spans_ranks sums their sums of squares.
class Mamba2Mixer : public SsmMixer {
 public:
  Mamba2Mixer(const ModelConfig& config, const std::string& prefix, const WeightMap& weights);

  at::Tensor forward(const at::Tensor& hidden, const AttentionMetadata& metadata,
                     const LayerKVCache& state) const override;

  int64_t weight_bytes() const override;

 private:
  SSMConfig ssm_;
  double norm_eps_;
  Linear in_proj_;
  Linear out_proj_;
  at::Tensor conv_weight_;  // [conv_dim, kernel]
  at::Tensor conv_bias_;    // [conv_dim] or undefined
  at::Tensor A_;            // fp32 [H]: -exp(A_log)
  at::Tensor D_;            // [H]
  at::Tensor dt_bias_;      // [H]
  at::Tensor norm_weight_;  // [inner]; undefined: the gate alone
  std::shared_ptr<Communicator> norm_ranks_;  // null: the norm's groups are this rank's

  // The gated norm of y and z [T, inner] over every rank's channels (one group).
  at::Tensor norm_across_ranks(const at::Tensor& y, const at::Tensor& z) const;
};

}  // namespace kvserve
