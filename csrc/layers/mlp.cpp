#include "layers/mlp.h"

#include <ATen/ops/empty.h>

#include "kernels/activation/silu_and_mul.h"

namespace kvserve {

GatedMLP::GatedMLP(const std::string& p, const WeightMap& w)
    : gate_up_proj_(w.get(p + "gate_up_proj.weight"), w.get_optional(p + "gate_up_proj.bias")),
      down_proj_(w.get(p + "down_proj.weight"), w.get_optional(p + "down_proj.bias")) {}

at::Tensor GatedMLP::forward(const at::Tensor& x) const {
  at::Tensor gate_up = gate_up_proj_.forward(x);
  at::Tensor act = at::empty({x.size(0), gate_up.size(1) / 2}, x.options());
  ops::silu_and_mul(act, gate_up);
  return down_proj_.forward(act);
}

}  // namespace kvserve
