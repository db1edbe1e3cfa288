#pragma once
// Maps a config.json `architectures` entry to the C++ class that runs it.

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "kvserve/causal_lm.h"

namespace kvserve {

/// The architectures kvserve can run, e.g. "LlamaForCausalLM".
std::vector<std::string> supported_architectures();

/// Builds the model for config.architecture from loader-named weights. Throws
/// std::invalid_argument naming the supported architectures when it is not one of them.
std::shared_ptr<CausalLM> create_causal_lm(const ModelConfig& config,
                                           std::unordered_map<std::string, at::Tensor> weights,
                                           int64_t max_positions);

}  // namespace kvserve
