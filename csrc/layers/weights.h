#pragma once
// Named weight tensors handed over by the loader, with clear errors for missing ones.

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <unordered_map>

#include "kvserve/communicator.h"
#include "kvserve/model_config.h"

namespace kvserve {

/// Weights by name (loader names, e.g. "layers.3.qkv_proj.weight"), the scheme that the
/// quantized ones (`<name>.qweight`) are in, and the ranks they are split over (this rank's
/// share of each sharded weight; local: the whole model).
class WeightMap {
 public:
  explicit WeightMap(std::unordered_map<std::string, at::Tensor> tensors,
                     QuantizationConfig quantization = {},
                     std::shared_ptr<Communicator> communicator = nullptr)
      : tensors_(std::move(tensors)),
        quantization_(std::move(quantization)),
        communicator_(communicator ? std::move(communicator) : local_communicator()) {}

  /// The tensor called `name`; throws std::invalid_argument when absent.
  const at::Tensor& get(const std::string& name) const;

  /// The tensor called `name`, or an undefined tensor.
  at::Tensor get_optional(const std::string& name) const;

  const QuantizationConfig& quantization() const { return quantization_; }
  const std::shared_ptr<Communicator>& communicator() const { return communicator_; }

 private:
  std::unordered_map<std::string, at::Tensor> tensors_;
  QuantizationConfig quantization_;
  std::shared_ptr<Communicator> communicator_;
};

}  // namespace kvserve
