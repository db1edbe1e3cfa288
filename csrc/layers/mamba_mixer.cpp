#include "layers/mamba_mixer.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/ones.h>

#include <optional>
#include <string>

#include "kernels/norm/rms_norm.h"
#include "kernels/norm/rms_norm_gated.h"
#include "kernels/ssm/ssm_causal_conv1d.h"
#include "kernels/ssm/ssm_scan.h"

namespace kvserve {

MambaMixer::MambaMixer(const ModelConfig& config, const std::string& p, const WeightMap& w)
    : ssm_(config.ssm),
      in_proj_(Linear::load(w, p + "in_proj")),
      x_proj_(Linear::load_row_parallel(w, p + "x_proj")),
      dt_proj_(Linear::load(w, p + "dt_proj")),
      out_proj_(Linear::load_row_parallel(w, p + "out_proj")) {
  const SSMConfig& c = ssm_;
  const int64_t inner = c.inner_size(), N = c.state_size, R = c.time_step_rank;
  check_linear_shape(in_proj_, p + "in_proj", 2 * inner, config.hidden_size);
  check_linear_shape(x_proj_, p + "x_proj", R + 2 * N, inner);
  check_linear_shape(dt_proj_, p + "dt_proj", inner, R);
  check_linear_shape(out_proj_, p + "out_proj", config.hidden_size, inner);
  conv_weight_ = ssm_weight(w, p + "conv1d.weight", {inner, c.conv_kernel});
  if (c.conv_bias) conv_bias_ = ssm_weight(w, p + "conv1d.bias", {inner});
  // A in fp32 whatever the weights' dtype, as the reference computes it.
  A_ = -at::exp(ssm_weight(w, p + "A_log", {inner, N}).to(at::kFloat));
  D_ = ssm_weight(w, p + "D", {inner});
  dt_bias_ = ssm_weight(w, p + "dt_bias", {inner});
  if (c.dt_bc_norm == "weighted") {
    dt_norm_ = ssm_weight(w, p + "dt_norm.weight", {R});
    B_norm_ = ssm_weight(w, p + "B_norm.weight", {N});
    C_norm_ = ssm_weight(w, p + "C_norm.weight", {N});
  } else if (c.dt_bc_norm == "plain") {
    const at::TensorOptions fp32 = A_.options();
    dt_norm_ = at::ones({R}, fp32);
    B_norm_ = at::ones({N}, fp32);
    C_norm_ = at::ones({N}, fp32);
  }
}

at::Tensor MambaMixer::forward(const at::Tensor& hidden, const AttentionMetadata& metadata,
                               const LayerKVCache& state) const {
  const SSMConfig& c = ssm_;
  const int64_t tokens = hidden.size(0), inner = c.inner_size(), N = c.state_size;
  const int64_t R = c.time_step_rank;
  TORCH_CHECK(metadata.state_slots.defined() && metadata.has_initial_state.defined(),
              "MambaMixer: the batch carries no state slots");
  const at::Tensor projected = in_proj_.forward(hidden);  // [T, x | gate]
  const at::Tensor gate = projected.narrow(1, inner, inner);

  at::Tensor conv_state = state.key, ssm_state = state.value;
  at::Tensor x = at::empty({tokens, inner}, hidden.options());
  ops::ssm_causal_conv1d(x, projected.narrow(1, 0, inner), conv_weight_,
                         conv_bias_.defined() ? std::optional<at::Tensor>(conv_bias_)
                                              : std::nullopt,
                         conv_state, metadata.query_start_loc, metadata.state_slots,
                         metadata.has_initial_state, /*silu=*/true);
  const at::Tensor dbc = x_proj_.forward(x);  // [T, dt (R) | B (N) | C (N)]
  at::Tensor dt = dbc.narrow(1, 0, R), B = dbc.narrow(1, R, N), C = dbc.narrow(1, R + N, N);
  if (dt_norm_.defined()) {
    const auto normed = [&](const at::Tensor& v, const at::Tensor& weight) {
      at::Tensor out = at::empty(v.sizes(), v.options());
      ops::rms_norm(out, v, weight, c.dt_bc_norm_eps);
      return out;
    };
    dt = normed(dt, dt_norm_);
    B = normed(B, B_norm_);
    C = normed(C, C_norm_);
  }
  dt = dt_proj_.forward(dt.contiguous());  // [T, inner]; its bias is the scan's
  at::Tensor y = at::empty({tokens, inner, 1}, hidden.options());
  ops::ssm_scan(y, x.view({tokens, inner, 1}), dt, A_, B.view({tokens, 1, N}),
                C.view({tokens, 1, N}), D_, dt_bias_, ssm_state, metadata.query_start_loc,
                metadata.state_slots, metadata.has_initial_state, /*dt_softplus=*/true, c.dt_min,
                c.dt_max);
  at::Tensor gated = at::empty({tokens, inner}, hidden.options());
  ops::rms_norm_gated(gated, y.view({tokens, inner}), gate, std::nullopt, inner, 1e-6);
  return out_proj_.forward(gated);
}

int64_t MambaMixer::weight_bytes() const {
  int64_t bytes = in_proj_.weight_bytes() + x_proj_.weight_bytes() + dt_proj_.weight_bytes() +
                  out_proj_.weight_bytes();
  for (const at::Tensor* t :
       {&conv_weight_, &conv_bias_, &A_, &D_, &dt_bias_, &dt_norm_, &B_norm_, &C_norm_}) {
    if (t->defined()) bytes += static_cast<int64_t>(t->nbytes());
  }
  return bytes;
}

}  // namespace kvserve
