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
  at::Tensor packed = ops::linear_prepack(weight_);
  if (packed.defined()) weight_ = std::move(packed);  // the plain copy is released
}

at::Tensor Linear::forward(const at::Tensor& x) const {
  return ops::linear(x, weight_, bias_.defined() ? std::optional<at::Tensor>(bias_) : std::nullopt);
}

at::Tensor Linear::rows(const at::Tensor& ids) const { return ops::linear_gather_rows(weight_, ids); }

int64_t Linear::weight_bytes() const {
  if (!weight_.defined()) return 0;
  return ops::linear_weight_nbytes(weight_) +
         (bias_.defined() ? static_cast<int64_t>(bias_.nbytes()) : 0);
}

}  // namespace kvserve
