#include "layers/rotary.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/cos.h>
#include <ATen/ops/outer.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/reciprocal.h>
#include <ATen/ops/sin.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/where.h>

#include <cmath>
#include <numbers>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/rotary/rotary_embedding.h"

namespace kvserve {
namespace {

// theta^(-2i/d) for i < d/2, in fp32 like the reference implementation.
at::Tensor base_inverse_frequencies(double theta, int64_t dim) {
  at::Tensor exponents = at::arange(0, dim, 2, at::kLong).to(at::kFloat) / static_cast<double>(dim);
  return at::reciprocal(at::pow(theta, exponents));
}

// Llama 3: long wavelengths are divided by `factor`, short ones kept, the band between blended.
at::Tensor llama3_frequencies(const at::Tensor& inv_freq, const RopeScaling& s, int64_t max_pos) {
  const double old_context = s.original_max_position_embeddings > 0
                                 ? static_cast<double>(s.original_max_position_embeddings)
                                 : static_cast<double>(max_pos);
  const double low_freq_wavelen = old_context / s.low_freq_factor;
  const double high_freq_wavelen = old_context / s.high_freq_factor;
  at::Tensor wavelen = 2.0 * std::numbers::pi / inv_freq;
  at::Tensor scaled = at::where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq);
  at::Tensor smooth = (old_context / wavelen - s.low_freq_factor) /
                      (s.high_freq_factor - s.low_freq_factor);
  at::Tensor smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled;
  at::Tensor medium = (wavelen >= high_freq_wavelen).logical_and(wavelen <= low_freq_wavelen);
  return at::where(medium, smoothed, scaled);
}

double yarn_mscale(double scale, double mscale = 1.0) {
  return scale <= 1.0 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}

// YaRN: interpolate low frequencies, extrapolate high ones, with a linear ramp between.
at::Tensor yarn_frequencies(const ModelConfig& c, int64_t dim) {
  const RopeScaling& s = c.rope_scaling;
  const double max_pos = static_cast<double>(
      s.original_max_position_embeddings > 0 ? s.original_max_position_embeddings
                                             : c.max_position_embeddings);
  auto correction_dim = [&](double rotations) {
    return dim * std::log(max_pos / (rotations * 2.0 * std::numbers::pi)) /
           (2.0 * std::log(c.rope_theta));
  };
  double low = correction_dim(s.beta_fast), high = correction_dim(s.beta_slow);
  if (s.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(0.0, low);
  high = std::min(static_cast<double>(dim - 1), high);
  if (low == high) high += 0.001;  // avoid a zero-width ramp
  at::Tensor pos_freqs = at::pow(c.rope_theta, at::arange(0, dim, 2, at::kLong).to(at::kFloat) /
                                                   static_cast<double>(dim));
  at::Tensor extrapolation = 1.0 / pos_freqs;
  at::Tensor interpolation = 1.0 / (s.factor * pos_freqs);
  at::Tensor ramp = at::clamp((at::arange(dim / 2, at::kFloat) - low) / (high - low), 0, 1);
  at::Tensor extrapolation_weight = 1 - ramp;
  return interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight;
}

// LongRoPE (Phi-3): frequency i divided by factors[i]; the attention factor sqrt(1 + ln(factor) /
// ln(original context)) unless the config sets one.
std::pair<at::Tensor, double> longrope_frequencies(const ModelConfig& c, int64_t dim,
                                                   int64_t context) {
  const RopeScaling& s = c.rope_scaling;
  const int64_t original = s.original_max_position_embeddings > 0
                               ? s.original_max_position_embeddings
                               : c.max_position_embeddings;
  const std::vector<double>& factors = context > original ? s.long_factor : s.short_factor;
  if (static_cast<int64_t>(factors.size()) != dim / 2) {
    throw std::invalid_argument("longrope needs " + std::to_string(dim / 2) +
                                " factors per set (rotated dims / 2), got " +
                                std::to_string(factors.size()));
  }
  const at::Tensor divisors = at::tensor(factors, at::kDouble).to(at::kFloat);
  const at::Tensor exponents =
      at::arange(0, dim, 2, at::kLong).to(at::kFloat) / static_cast<double>(dim);
  const at::Tensor inv_freq = at::reciprocal(divisors * at::pow(c.rope_theta, exponents));
  const double attention =
      s.attention_factor > 0 ? s.attention_factor
      : s.factor <= 1.0      ? 1.0
                             : std::sqrt(1.0 + std::log(s.factor) / std::log(double(original)));
  return {inv_freq, attention};
}

}  // namespace

std::pair<at::Tensor, double> rope_inverse_frequencies(const ModelConfig& c, int64_t context) {
  const RopeScaling& s = c.rope_scaling;
  const int64_t dim = c.rotary_dim > 0 ? c.rotary_dim : c.head_dim;
  if (s.rope_type == "longrope") {
    return longrope_frequencies(c, dim, context > 0 ? context : c.max_position_embeddings);
  }
  at::Tensor inv_freq = base_inverse_frequencies(c.rope_theta, dim);
  if (s.rope_type == "default") return {inv_freq, 1.0};
  if (s.rope_type == "linear") return {inv_freq / s.factor, 1.0};
  if (s.rope_type == "llama3") {
    return {llama3_frequencies(inv_freq, s, c.max_position_embeddings), 1.0};
  }
  if (s.rope_type == "yarn") {
    // DeepSeek sets mscale and mscale_all_dim; their ratio scales cos/sin (usually 1: the
    // softmax scale takes mscale_all_dim instead).
    const double attention = s.attention_factor > 0 ? s.attention_factor
                             : s.mscale > 0 && s.mscale_all_dim > 0
                                 ? yarn_mscale(s.factor, s.mscale) /
                                       yarn_mscale(s.factor, s.mscale_all_dim)
                                 : yarn_mscale(s.factor);
    return {yarn_frequencies(c, dim), attention};
  }
  throw std::invalid_argument("unsupported rope_type '" + s.rope_type +
                              "' (supported: default, linear, llama3, yarn, longrope)");
}

RotaryEmbedding::RotaryEmbedding(const ModelConfig& config, int64_t max_positions,
                                 at::Device device, bool is_neox)
    : head_dim_(config.head_dim), is_neox_(is_neox) {
  auto [inv_freq, attention_scaling] = rope_inverse_frequencies(config, max_positions);
  at::Tensor freqs = at::outer(at::arange(max_positions, at::kFloat), inv_freq);
  cos_sin_cache_ =
      at::cat({at::cos(freqs) * attention_scaling, at::sin(freqs) * attention_scaling}, 1)
          .contiguous()
          .to(device);
}

void RotaryEmbedding::apply(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                            const RMSNorm* query_norm, const RMSNorm* key_norm) const {
  auto weight = [](const RMSNorm* norm) {
    return norm ? std::optional<at::Tensor>(norm->weight()) : std::nullopt;
  };
  TORCH_CHECK(!query_norm || !key_norm || query_norm->epsilon() == key_norm->epsilon(),
              "RotaryEmbedding: query and key norms with different epsilons");
  const double epsilon = query_norm ? query_norm->epsilon() : key_norm ? key_norm->epsilon() : 0;
  ops::rotary_embedding(positions, query, key, head_dim_, cos_sin_cache_, is_neox_,
                        weight(query_norm), weight(key_norm), epsilon);
}

}  // namespace kvserve
