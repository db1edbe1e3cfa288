#include "models/model_factory.h"

#include <functional>
#include <stdexcept>
#include <utility>

#include "models/deepseek_v2.h"
#include "models/llama.h"

namespace kvserve {
namespace {

using Factory = std::function<std::shared_ptr<CausalLM>(const ModelConfig&, const WeightMap&,
                                                        int64_t)>;

template <typename Model>
Factory factory() {
  return [](const ModelConfig& config, const WeightMap& weights, int64_t max_positions) {
    return std::make_shared<Model>(config, weights, max_positions);
  };
}

/// One entry per family, in the order model_families() lists them.
const std::vector<std::pair<std::string, Factory>>& families() {
  static const std::vector<std::pair<std::string, Factory>> table = {
      {"llama", factory<LlamaForCausalLM>()},
      {"deepseek_v2", factory<DeepseekV2ForCausalLM>()},
  };
  return table;
}

}  // namespace

std::vector<std::string> model_families() {
  std::vector<std::string> names;
  for (const auto& [name, make] : families()) names.push_back(name);
  return names;
}

std::shared_ptr<CausalLM> create_causal_lm(const ModelConfig& config,
                                           std::unordered_map<std::string, at::Tensor> weights,
                                           int64_t max_positions,
                                           std::shared_ptr<Communicator> communicator) {
  for (const auto& [name, make] : families()) {
    if (name == config.family) {
      return make(config,
                  WeightMap(std::move(weights), config.quantization, std::move(communicator)),
                  max_positions);
    }
  }
  std::string list;
  for (const auto& name : model_families()) list += (list.empty() ? "" : ", ") + name;
  throw std::invalid_argument("unknown model family '" + config.family + "' (of " +
                              config.architecture + "); kvserve's are: " + list);
}

}  // namespace kvserve
