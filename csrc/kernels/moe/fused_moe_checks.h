#pragma once
// Argument checks of fused_moe shared by its CPU and CUDA launchers, and the routing tensors'
// checks that fused_moe_quantized shares too. Shapes, dtypes and devices only: expert ids are
// checked where the host holds them (routed_experts_cpu); the CUDA bodies skip a bad one.

#include <ATen/core/Tensor.h>

#include "kernels/op_checks.h"

namespace kvserve::ops {

/// topk_weights fp32 and topk_ids int64, both contiguous [hidden.size(0), k] on hidden's device.
void check_moe_topk(const char* op, const at::Tensor& hidden,
                    const at::Tensor& topk_weights, const at::Tensor& topk_ids);

/// Every weight of `weights` is [rows, cols] of hidden's dtype, on hidden's device.
void check_moe_experts(const char* name, at::TensorList weights, int64_t rows,
                       int64_t cols, const at::Tensor& hidden);

/// hidden [T, hidden_size] (last dim contiguous), one w13 [2 * inter, hidden_size] and one w2
/// [hidden_size, inter] per expert, and the routing tensors (see fused_moe.h).
void check_fused_moe(const at::Tensor& hidden, at::TensorList w13, at::TensorList w2,
                     const at::Tensor& topk_weights, const at::Tensor& topk_ids);

}  // namespace kvserve::ops
