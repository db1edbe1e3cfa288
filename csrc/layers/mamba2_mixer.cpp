#include "layers/mamba2_mixer.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/rsqrt.h>
#include <ATen/ops/silu.h>

#include <stdexcept>
#include <string>

#include "kernels/norm/rms_norm_gated.h"
#include "kernels/ssm/ssm_causal_conv1d.h"
#include "kernels/ssm/ssm_scan.h"

namespace kvserve {

Mamba2Mixer::Mamba2Mixer(const ModelConfig& config, const std::string& p, const WeightMap& w)
    : ssm_(config.ssm),
      norm_eps_(config.rms_norm_eps),
      in_proj_(Linear::load(w, p + "in_proj")),
      out_proj_(Linear::load_row_parallel(w, p + "out_proj")) {
  const SSMConfig& c = ssm_;
  const int64_t inner = c.inner_size(), conv_dim = c.conv_dim();
  check_linear_shape(in_proj_, p + "in_proj", inner + conv_dim + c.num_heads, config.hidden_size);
  check_linear_shape(out_proj_, p + "out_proj", config.hidden_size, inner);
  conv_weight_ = ssm_weight(w, p + "conv1d.weight", {conv_dim, c.conv_kernel});
  if (c.conv_bias) conv_bias_ = ssm_weight(w, p + "conv1d.bias", {conv_dim});
  // A in fp32 whatever the weights' dtype, as the reference computes it.
  A_ = -at::exp(ssm_weight(w, p + "A_log", {c.num_heads}).to(at::kFloat));
  D_ = ssm_weight(w, p + "D", {c.num_heads});
  dt_bias_ = ssm_weight(w, p + "dt_bias", {c.num_heads});
  if (c.norm != "gate_only") norm_weight_ = ssm_weight(w, p + "norm.weight", {inner});
  if (c.norm_spans_ranks && c.norm != "gate_only" && w.communicator()->size() > 1) {
    TORCH_CHECK(c.norm_groups == 1, p, ": a gated norm across ranks is one group a rank");
    norm_ranks_ = w.communicator();
  }
}

at::Tensor Mamba2Mixer::norm_across_ranks(const at::Tensor& y, const at::Tensor& z) const {
  // The reference's order (testing/ssm_reference.py) in fp32: the gate, the mean square over
  // every rank's channels, the weight, then (norm_then_gate) the gate.
  const at::Tensor yf = y.to(at::kFloat), gate = at::silu(z.to(at::kFloat));
  const bool gate_first = ssm_.norm == "gate_then_norm";
  const at::Tensor h = gate_first ? yf.mul(gate) : yf;
  at::Tensor sums = h.square().sum(1, /*keepdim=*/true);
  norm_ranks_->all_reduce_(sums);
  const double width = static_cast<double>(h.size(1) * norm_ranks_->size());
  at::Tensor out = h.mul(at::rsqrt(sums.div(width).add(norm_eps_))).mul(norm_weight_.to(at::kFloat));
  if (!gate_first) out.mul_(gate);
  return out.to(y.scalar_type());
}

at::Tensor Mamba2Mixer::forward(const at::Tensor& hidden, const AttentionMetadata& metadata,
                                const LayerKVCache& state) const {
  const SSMConfig& c = ssm_;
  const int64_t tokens = hidden.size(0), inner = c.inner_size(), conv_dim = c.conv_dim();
  const int64_t group_states = c.n_groups * c.state_size;
  TORCH_CHECK(metadata.state_slots.defined() && metadata.has_initial_state.defined(),
              "Mamba2Mixer: the batch carries no state slots");
  const at::Tensor projected = in_proj_.forward(hidden);  // [T, z | x B C | dt]
  const at::Tensor z = projected.narrow(1, 0, inner);
  const at::Tensor xbc = projected.narrow(1, inner, conv_dim);
  const at::Tensor dt = projected.narrow(1, inner + conv_dim, c.num_heads);

  at::Tensor conv_state = state.key, ssm_state = state.value;
  at::Tensor convolved = at::empty({tokens, conv_dim}, hidden.options());
  ops::ssm_causal_conv1d(convolved, xbc, conv_weight_,
                         conv_bias_.defined() ? std::optional<at::Tensor>(conv_bias_)
                                              : std::nullopt,
                         conv_state, metadata.query_start_loc, metadata.state_slots,
                         metadata.has_initial_state, /*silu=*/true);
  const at::Tensor x = convolved.narrow(1, 0, inner).view({tokens, c.num_heads, c.head_dim});
  const at::Tensor B =
      convolved.narrow(1, inner, group_states).view({tokens, c.n_groups, c.state_size});
  const at::Tensor C = convolved.narrow(1, inner + group_states, group_states)
                           .view({tokens, c.n_groups, c.state_size});
  at::Tensor y = at::empty({tokens, c.num_heads, c.head_dim}, hidden.options());
  ops::ssm_scan(y, x, dt, A_, B, C, D_, dt_bias_, ssm_state, metadata.query_start_loc,
                metadata.state_slots, metadata.has_initial_state, /*dt_softplus=*/true, c.dt_min,
                c.dt_max);
  if (norm_ranks_) return out_proj_.forward(norm_across_ranks(y.view({tokens, inner}), z));
  at::Tensor normed = at::empty({tokens, inner}, hidden.options());
  ops::rms_norm_gated(normed, y.view({tokens, inner}), z,
                      norm_weight_.defined() ? std::optional<at::Tensor>(norm_weight_)
                                             : std::nullopt,
                      inner / c.norm_groups, norm_eps_, c.norm == "norm_then_gate");
  return out_proj_.forward(normed);
}

int64_t Mamba2Mixer::weight_bytes() const {
  int64_t bytes = in_proj_.weight_bytes() + out_proj_.weight_bytes();
  for (const at::Tensor* t : {&conv_weight_, &conv_bias_, &A_, &D_, &dt_bias_, &norm_weight_}) {
    if (t->defined()) bytes += static_cast<int64_t>(t->nbytes());
  }
  return bytes;
}

}  // namespace kvserve
