#include "models/model_factory.h"

#include <algorithm>
#include <stdexcept>

#include "models/deepseek_v2.h"
#include "models/llama.h"

namespace kvserve {

std::vector<std::string> supported_architectures() {
  return {"LlamaForCausalLM",   "MistralForCausalLM",  "Qwen2ForCausalLM",
          "Qwen3ForCausalLM",   "MixtralForCausalLM",  "Qwen3MoeForCausalLM",
          "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Gemma2ForCausalLM",
          "Gemma3ForCausalLM"};
}

std::shared_ptr<CausalLM> create_causal_lm(const ModelConfig& config,
                                           std::unordered_map<std::string, at::Tensor> weights,
                                           int64_t max_positions) {
  const auto names = supported_architectures();
  if (std::find(names.begin(), names.end(), config.architecture) == names.end()) {
    std::string list;
    for (const auto& name : names) list += (list.empty() ? "" : ", ") + name;
    throw std::invalid_argument("unsupported architecture '" + config.architecture +
                                "'; kvserve supports: " + list);
  }
  WeightMap w(std::move(weights));
  if (config.architecture == "DeepseekV2ForCausalLM" ||
      config.architecture == "DeepseekV3ForCausalLM") {
    return std::make_shared<DeepseekV2ForCausalLM>(config, w, max_positions);
  }
  // The other families share the Llama layer structure; ModelConfig flags carry the rest.
  return std::make_shared<LlamaForCausalLM>(config, w, max_positions);
}

}  // namespace kvserve
