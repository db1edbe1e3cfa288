#pragma once
// Argument checks of lora_add shared by its CPU and CUDA launchers (shapes, dtypes, devices; the
// CPU launcher also checks the slots' values on the host).

#include <ATen/core/Tensor.h>

#include "kernels/op_checks.h"

namespace kvserve::ops {

inline void check_lora_add(const at::Tensor& out, const at::Tensor& x, const at::Tensor& lora_a,
                           const at::Tensor& lora_b, const at::Tensor& slots,
                           const at::Tensor& scales) {
  constexpr const char* kOp = "lora_add";
  check_rows(kOp, "x", x, 2);
  check_rows(kOp, "out", out, 2);
  check_like(kOp, "out", out, x);
  TORCH_CHECK(out.size(0) == x.size(0), kOp, ": x and out must have one row per token, got ",
              x.sizes(), " and ", out.sizes());
  check_like(kOp, "lora_a", lora_a, x);
  check_like(kOp, "lora_b", lora_b, x);
  TORCH_CHECK(lora_a.dim() == 3 && lora_a.is_contiguous() && lora_a.size(2) == x.size(1), kOp,
              ": lora_a must be contiguous [num_slots, rank, ", x.size(1), "], got ",
              lora_a.sizes());
  TORCH_CHECK(lora_b.dim() == 3 && lora_b.is_contiguous() && lora_b.size(0) == lora_a.size(0) &&
                  lora_b.size(1) == lora_a.size(1) && lora_b.size(2) == out.size(1),
              kOp, ": lora_b must be contiguous [", lora_a.size(0), ", ", lora_a.size(1), ", ",
              out.size(1), "] (B transposed), got ", lora_b.sizes());
  check_contiguous(kOp, "slots", slots, at::kInt);
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == x.size(0), kOp,
              ": slots must be [", x.size(0), "], got ", slots.sizes());
  check_contiguous(kOp, "scales", scales, at::kFloat);
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == lora_a.size(0), kOp, ": scales must be [",
              lora_a.size(0), "], got ", scales.sizes());
  TORCH_CHECK(slots.device() == x.device() && scales.device() == x.device(), kOp,
              ": slots and scales must be on ", x.device());
}

}  // namespace kvserve::ops
