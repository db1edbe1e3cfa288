#pragma once
// Named weight tensors handed over by the loader, with clear errors for missing ones.

#include <ATen/core/Tensor.h>

#include <string>
#include <unordered_map>

namespace kvserve {

/// Weights by name (loader names, e.g. "layers.3.qkv_proj.weight").
class WeightMap {
 public:
  explicit WeightMap(std::unordered_map<std::string, at::Tensor> tensors)
      : tensors_(std::move(tensors)) {}

  /// The tensor called `name`; throws std::invalid_argument when absent.
  const at::Tensor& get(const std::string& name) const;

  /// The tensor called `name`, or an undefined tensor.
  at::Tensor get_optional(const std::string& name) const;

 private:
  std::unordered_map<std::string, at::Tensor> tensors_;
};

}  // namespace kvserve
