#pragma once
// Argument checks of rotary_embedding shared by its CPU and CUDA launchers (shapes and dtypes
// only: the positions' range is checked on the host by the CPU launcher alone).

#include <ATen/core/Tensor.h>

#include "kernels/op_checks.h"

namespace kvserve::ops {

void check_rotary_embedding(const at::Tensor& positions, const at::Tensor& query,
                            const at::Tensor& key, int64_t head_dim,
                            const at::Tensor& cos_sin_cache);

}  // namespace kvserve::ops
