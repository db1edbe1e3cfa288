#pragma once
// Maps a ModelConfig's family to the C++ class that runs it. Which architectures (config.json
// `architectures` entries) belong to which family is kvserve.architectures' table.

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "kvserve/causal_lm.h"
#include "kvserve/communicator.h"

namespace kvserve {

/// The model families kvserve has C++ classes for: "llama" (the Llama layer structure, adapted
/// by ModelConfig's flags: Mistral, Qwen2/3, Mixtral, Qwen3-MoE, Gemma 2/3) and "deepseek_v2"
/// (multi-head latent attention, DeepSeek-V2/V3).
std::vector<std::string> model_families();

/// Builds the model of config.family from loader-named weights. Throws std::invalid_argument
/// naming the families when it is not one of them. With a `communicator` of several ranks (tensor
/// parallelism), `config` and `weights` are this rank's share (kvserve.loader's sharded load:
/// its heads and intermediate columns) and the row-parallel projections sum over the ranks; null:
/// one rank.
std::shared_ptr<CausalLM> create_causal_lm(const ModelConfig& config,
                                           std::unordered_map<std::string, at::Tensor> weights,
                                           int64_t max_positions,
                                           std::shared_ptr<Communicator> communicator = nullptr);

}  // namespace kvserve
