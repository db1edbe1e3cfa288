#include "layers/linear.h"


#include <stdexcept>

#include "kernels/linear/linear.h"
#include "layers/weights.h"

namespace kvserve {

const at::Tensor& WeightMap::get(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) throw std::invalid_argument("missing weight: " + name);
  return it->second;
}

at::Tensor WeightMap::get_optional(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? at::Tensor() : it->second;
}

Linear::Linear(at::Tensor weight, at::Tensor bias) : weight_(std::move(weight)), bias_(std::move(bias)) {
  TORCH_CHECK(weight_.dim() == 2, "Linear: weight must be [out, in], got ", weight_.sizes());
  TORCH_CHECK(!bias_.defined() || (bias_.dim() == 1 && bias_.size(0) == weight_.size(0)),
              "Linear: bias must be [", weight_.size(0), "]");
  weight_ = weight_.contiguous();
  packed_weight_ = ops::linear_prepack(weight_);
}

at::Tensor Linear::forward(const at::Tensor& x) const {
  auto optional = [](const at::Tensor& t) {
    return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
  };
  return ops::linear(x, weight_, optional(bias_), optional(packed_weight_));
}

int64_t Linear::weight_bytes() const {
  // A packed tensor has no storage to ask; its layout pads little, so count it like the weight.
  const int64_t packed = packed_weight_.defined() ? weight_.numel() * weight_.element_size() : 0;
  return weight_.nbytes() + packed + (bias_.defined() ? static_cast<int64_t>(bias_.nbytes()) : 0);
}

}  // namespace kvserve
