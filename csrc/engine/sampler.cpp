#include "kvserve/sampler.h"

#include <ATen/ops/from_blob.h>

#include <cmath>
#include <sstream>
#include <stdexcept>

#include "kernels/sampling/sampling.h"

namespace kvserve {
namespace {

void require(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument("SamplingParams: " + message);
}

}  // namespace

void SamplingParams::validate() const {
  require(std::isfinite(temperature) && temperature >= 0.0,
          "temperature must be a finite number >= 0, got " + std::to_string(temperature));
  require(top_k == -1 || top_k >= 1, "top_k must be -1 (off) or >= 1, got " + std::to_string(top_k));
  require(top_p > 0.0 && top_p <= 1.0, "top_p must be in (0, 1], got " + std::to_string(top_p));
  require(min_p >= 0.0 && min_p <= 1.0, "min_p must be in [0, 1], got " + std::to_string(min_p));
  require(max_tokens >= 1, "max_tokens must be >= 1, got " + std::to_string(max_tokens));
  for (int64_t id : stop_token_ids) {
    require(id >= 0, "stop_token_ids must be non-negative, got " + std::to_string(id));
  }
}

std::string SamplingParams::repr() const {
  std::ostringstream out;
  out << "SamplingParams(temperature=" << temperature << ", top_k=" << top_k
      << ", top_p=" << top_p << ", min_p=" << min_p << ", seed=";
  if (seed) out << *seed; else out << "None";
  out << ", max_tokens=" << max_tokens << ", ignore_eos=" << (ignore_eos ? "True" : "False")
      << ", stop_token_ids=[";
  for (size_t i = 0; i < stop_token_ids.size(); ++i) out << (i ? ", " : "") << stop_token_ids[i];
  out << "])";
  return out.str();
}

RequestRandom::RequestRandom(std::optional<uint64_t> seed)
    : engine_(seed ? *seed : (static_cast<uint64_t>(std::random_device{}()) << 32) ^
                                 std::random_device{}()) {}

float RequestRandom::next_uniform() {
  // 24 random bits: every value is exact in fp32 and strictly below 1.
  return static_cast<float>(engine_() >> 40) * (1.0f / 16777216.0f);
}

at::Tensor Sampler::sample(at::Tensor& logits, const std::vector<const SamplingParams*>& params,
                           const std::vector<RequestRandom*>& randoms) const {
  const int64_t rows = logits.size(0);
  TORCH_CHECK(static_cast<int64_t>(params.size()) == rows &&
                  static_cast<int64_t>(randoms.size()) == rows,
              "Sampler: need one SamplingParams and one random stream per row");
  std::vector<float> temperature(rows), top_p(rows), min_p(rows), uniform(rows, 0.0f);
  std::vector<int64_t> top_k(rows);
  bool any_filter = false;
  for (int64_t r = 0; r < rows; ++r) {
    const SamplingParams& p = *params[r];
    temperature[r] = static_cast<float>(p.temperature);
    top_k[r] = p.top_k;
    top_p[r] = static_cast<float>(p.top_p);
    min_p[r] = static_cast<float>(p.min_p);
    if (p.temperature > 0.0) {
      uniform[r] = randoms[r]->next_uniform();
      any_filter = true;
    }
  }
  const auto device = logits.device();
  auto host = [&](auto& v, at::ScalarType dtype) {
    return at::from_blob(v.data(), {rows}, at::TensorOptions().dtype(dtype)).to(device);
  };
  at::Tensor temperature_t = host(temperature, at::kFloat);
  if (any_filter) {
    ops::sampling_filter_logits(logits, temperature_t, host(top_k, at::kLong),
                                host(top_p, at::kFloat), host(min_p, at::kFloat));
  }
  // On the CPU the parameter tensors alias the vectors above, which outlive the ops.
  return ops::sampling_from_logits(logits, temperature_t, host(uniform, at::kFloat)).cpu();
}

}  // namespace kvserve
