// quantized_linear's input rounded to int8 blocks (quantize_input), in ATen ops on any device:
// what the CPU's integer kernels multiply, for the paths that multiply in floating point.
#include <ATen/ops/abs.h>
#include <ATen/ops/all.h>
#include <ATen/ops/amax.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/div.h>
#include <ATen/ops/full_like.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/round.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros_like.h>
#include <ATen/TensorOperators.h>

#include <limits>

#include "kernels/linear/quantized_linear.h"

namespace kvserve::ops {

at::Tensor round_input_to_int8_blocks(const at::Tensor& input, int64_t group_size) {
  constexpr int64_t kBlock = 32;
  const int64_t m = input.size(0), k = input.size(1), groups = k / group_size;
  const int64_t per_group = (group_size + kBlock - 1) / kBlock;
  const int64_t padded = per_group * kBlock;
  // [m, groups, blocks of the group, 32], a short last block padded with zeros (no effect on max).
  at::Tensor x = input.to(at::kFloat).reshape({m, groups, group_size});
  if (padded != group_size) x = at::constant_pad_nd(x, {0, padded - group_size});
  x = x.reshape({m, groups, per_group, kBlock});
  const at::Tensor amax = x.abs().amax({-1}, /*keepdim=*/true);
  const at::Tensor finite = at::isfinite(x).all(-1, /*keepdim=*/true);
  // Element-wise divisions: ATen multiplies by the reciprocal when dividing by a scalar, which
  // rounds differently from the kernels' fp32 division.
  const at::Tensor full = at::full_like(amax, 127.0);
  const at::Tensor inverse = at::where(amax > 0, at::div(full, amax), at::zeros_like(amax));
  const at::Tensor scale = at::where(finite, at::div(amax, full),
                                     std::numeric_limits<float>::quiet_NaN());
  const at::Tensor q = at::where(finite, at::round(x * inverse).clamp(-127, 127), 0.0);
  at::Tensor out = (q * scale).reshape({m, groups, padded});
  if (padded != group_size) out = out.narrow(2, 0, group_size);
  return out.reshape({m, k});
}

}  // namespace kvserve::ops
