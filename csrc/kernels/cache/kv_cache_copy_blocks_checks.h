#pragma once
// Argument checks of kv_cache_copy_blocks shared by its CPU and CUDA launchers: the tensors'
// shapes, and the pairs' values wherever the host holds them.

#include <ATen/core/Tensor.h>

#include <unordered_set>

#include "kernels/op_checks.h"

namespace kvserve::ops {

/// The caches (one shape, dtype and device, contiguous) and block_mapping's shape and dtype.
void check_kv_cache_copy_blocks(at::TensorList key_caches, at::TensorList value_caches,
                                const at::Tensor& block_mapping);

/// Every id inside the pool, no destination twice, no destination that is also a source.
/// pairs: host memory, [num_pairs, 2].
void check_block_pairs(const int64_t* pairs, int64_t num_pairs, int64_t num_blocks);

}  // namespace kvserve::ops
