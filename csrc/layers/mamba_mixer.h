#pragma once
// Mamba's selective state-space mixer (Gu & Dao, "Mamba: Linear-Time Sequence Modeling with
// Selective State Spaces", 2023), the layer of Mamba, FalconMamba and Jamba's SSM layers: an
// input projection to x and a gate, a short causal convolution of x, B, C and a low-rank time
// step projected from the convolved x, the selective scan with a decay per channel and state
// entry (ops/ssm_scan.h, a channel a head), the gate, and the output projection.

#include <ATen/core/Tensor.h>

#include <string>

#include "kvserve/attention_metadata.h"
#include "kvserve/model_config.h"
#include "layers/linear.h"
#include "layers/ssm_mixer.h"
#include "layers/weights.h"

namespace kvserve {

/// One layer's mixer (config.ssm, kind "mamba"; inner = ssm.inner_size(), N = state_size, R =
/// time_step_rank). Weights under `prefix`: in_proj.weight [2 * inner, hidden] (x, then the
/// gate; + bias with ssm.proj_bias), conv1d.weight [inner, kernel] (+ conv1d.bias),
/// x_proj.weight [R + 2 * N, inner] (dt, B, C), dt_proj.weight [inner, R], dt_bias [inner],
/// A_log [inner, N] (A = -exp(A_log)), D [inner], out_proj.weight [hidden, inner] (+ bias with
/// ssm.out_proj_bias); with dt_bc_norm "weighted", dt_norm.weight [R], B_norm.weight [N] and
/// C_norm.weight [N]. Split over tensor-parallel ranks (each a share of the inner channels:
/// kvserve/loader/sharding.py), x_proj and out_proj sum the ranks' outputs: every rank gets the
/// whole dt, B and C.
class MambaMixer : public SsmMixer {
 public:
  MambaMixer(const ModelConfig& config, const std::string& prefix, const WeightMap& weights);

  at::Tensor forward(const at::Tensor& hidden, const AttentionMetadata& metadata,
                     const LayerKVCache& state) const override;

  int64_t weight_bytes() const override;

 private:
  SSMConfig ssm_;
  Linear in_proj_;
  Linear x_proj_;
  Linear dt_proj_;          // without its bias (dt_bias_, added in the scan)
  Linear out_proj_;
  at::Tensor conv_weight_;  // [inner, kernel]
  at::Tensor conv_bias_;    // [inner] or undefined
  at::Tensor A_;            // fp32 [inner, N]: -exp(A_log)
  at::Tensor D_;            // [inner]
  at::Tensor dt_bias_;      // [inner]
  // dt_bc_norm: RMSNorm weights of dt [R], B [N], C [N] (fp32 ones when "plain"); undefined
  // when "none".
  at::Tensor dt_norm_, B_norm_, C_norm_;
};

}  // namespace kvserve
