#include "layers/ssm_mixer.h"

#include <stdexcept>
#include <string>

#include "layers/mamba2_mixer.h"
#include "layers/mamba_mixer.h"

namespace kvserve {

std::unique_ptr<SsmMixer> make_ssm_mixer(const ModelConfig& config, const std::string& prefix,
                                         const WeightMap& weights) {
  if (config.ssm.kind == "mamba") return std::make_unique<MambaMixer>(config, prefix, weights);
  return std::make_unique<Mamba2Mixer>(config, prefix, weights);
}

at::Tensor ssm_weight(const WeightMap& weights, const std::string& name,
                      const std::vector<int64_t>& shape) {
  const at::Tensor& t = weights.get(name);
  if (t.sizes() != at::IntArrayRef(shape)) {
    std::string want;
    for (const int64_t d : shape) want += (want.empty() ? "" : ", ") + std::to_string(d);
    throw std::invalid_argument(name + " must be [" + want + "]");
  }
  return t.contiguous();
}

void check_linear_shape(const Linear& linear, const std::string& name, int64_t out_features,
                        int64_t in_features) {
  if (linear.out_features() != out_features || linear.in_features() != in_features) {
    throw std::invalid_argument(name + " must be [" + std::to_string(out_features) + ", " +
                                std::to_string(in_features) + "]");
  }
}

}  // namespace kvserve
