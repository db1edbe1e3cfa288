#pragma once
// Argument checks of quantized_linear shared by its CPU and CUDA launchers (and by
// fused_moe_quantized's, which check each projection with them).

#include <ATen/core/Tensor.h>

#include <optional>

#include "kernels/cpu_kernels.h"
#include "kernels/op_checks.h"

namespace kvserve::ops {

/// The format qweight's dtype stores q in; throws for any other dtype.
inline cpu::QuantFormat quantized_format_of(const at::Tensor& qweight) {
  switch (qweight.scalar_type()) {
    case at::kChar: return cpu::QuantFormat::kInt8;
    case at::kByte: return cpu::QuantFormat::kInt4;
    case at::kFloat8_e4m3fn: return cpu::QuantFormat::kFp8E4M3;
    default:
      TORCH_CHECK(false, "quantized_linear: qweight must be int8 (int8), uint8 (packed int4) or "
                         "float8_e4m3fn (fp8), got ", qweight.scalar_type());
  }
}

/// Checks scales or zeros: contiguous [n, groups] in `dtype` (fp32 or fp16, scales' dtype), or,
/// where `one_for_all`, a single element [1].
inline void check_quantized_params(const char* name, const at::Tensor& t, int64_t n,
                                   int64_t groups, at::ScalarType dtype,
                                   bool one_for_all = false) {
  constexpr const char* op = "quantized_linear";
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf, op,
              ": scales must be fp32 or fp16, got ", dtype);
  check_contiguous(op, name, t, dtype);
  if (one_for_all && t.dim() == 1 && t.size(0) == 1) return;
  TORCH_CHECK(t.dim() == 2 && t.size(0) == n && t.size(1) == groups, op, ": ", name,
              " must be [", n, ", ", groups, "] (one per output row and group)",
              one_for_all ? " or [1] (one for all)" : "", ", got ", t.sizes());
}

/// Whether zeros is a single zero for every row and group ([1]; check_quantized_params).
inline bool is_shared_zero(const std::optional<at::Tensor>& zeros) {
  return zeros && zeros->dim() == 1;
}

/// Checks two-level scales (quantized_linear.h): scales, and zeros if any, int8 [n, groups];
/// super_scales, and super_mins exactly where there are zeros, [n, supers] in fp32 or fp16 with
/// supers dividing groups. Returns the groups a super-block holds.
inline int64_t check_two_level_params(const at::Tensor& scales,
                                      const std::optional<at::Tensor>& zeros,
                                      const at::Tensor& super_scales,
                                      const std::optional<at::Tensor>& super_mins, int64_t n,
                                      int64_t groups) {
  constexpr const char* op = "quantized_linear";
  check_contiguous(op, "scales", scales, at::kChar);
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == n && scales.size(1) == groups, op,
              ": two-level scales must be int8 [", n, ", ", groups, "], got ", scales.sizes());
  const at::ScalarType dtype = super_scales.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf, op,
              ": super_scales must be fp32 or fp16, got ", dtype);
  check_contiguous(op, "super_scales", super_scales, dtype);
  TORCH_CHECK(super_scales.dim() == 2 && super_scales.size(0) == n && super_scales.size(1) > 0 &&
                  groups % super_scales.size(1) == 0,
              op, ": super_scales must be [", n, ", supers] with supers dividing the ", groups,
              " groups, got ", super_scales.sizes());
  TORCH_CHECK(zeros.has_value() == super_mins.has_value(), op,
              ": two-level zeros and super_mins come together (or neither)");
  if (zeros) {
    check_contiguous(op, "zeros", *zeros, at::kChar);
    TORCH_CHECK(zeros->sizes() == scales.sizes(), op, ": two-level zeros must be int8 [", n, ", ",
                groups, "], got ", zeros->sizes());
    check_contiguous(op, "super_mins", *super_mins, dtype);
    TORCH_CHECK(super_mins->sizes() == super_scales.sizes(), op,
                ": super_mins must be shaped as super_scales ", super_scales.sizes(), ", got ",
                super_mins->sizes());
  }
  return groups / super_scales.size(1);
}

/// Every shape, dtype, device and group size of quantized_linear.h; returns qweight's format.
inline cpu::QuantFormat check_quantized_linear(
    const at::Tensor& input, const at::Tensor& qweight, const at::Tensor& scales,
    const std::optional<at::Tensor>& zeros, int64_t group_size,
    const std::optional<at::Tensor>& bias, bool quantize_input = false,
    const std::optional<at::Tensor>& super_scales = std::nullopt,
    const std::optional<at::Tensor>& super_mins = std::nullopt) {
  constexpr const char* op = "quantized_linear";
  check_rows(op, "input", input, 2);
  const at::ScalarType dtype = input.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op,
              ": input must be fp32, bf16 or fp16, got ", dtype);
  const cpu::QuantFormat format = quantized_format_of(qweight);
  const bool int4 = format == cpu::QuantFormat::kInt4;
  const int64_t k = input.size(1);
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() &&
                  qweight.size(1) * (int4 ? 2 : 1) == k,
              op, ": qweight must be contiguous [n, ", int4 ? k / 2 : k, "] for ", k,
              " inputs", int4 ? " (two int4 per byte)" : "", ", got ", qweight.sizes());
  const int64_t n = qweight.size(0);
  TORCH_CHECK(group_size > 0 && k % group_size == 0, op, ": group_size must divide the ", k,
              " inputs, got ", group_size);
  TORCH_CHECK(!int4 || group_size % 32 == 0, op,
              ": int4 weights need a group_size that is a multiple of 32, got ", group_size);
  TORCH_CHECK(!quantize_input || format != cpu::QuantFormat::kFp8E4M3, op,
              ": quantize_input takes int8 or int4 weights, not fp8");
  const int64_t groups = k / group_size;
  if (super_scales) {
    TORCH_CHECK(format != cpu::QuantFormat::kFp8E4M3, op,
                ": two-level scales take int8 or int4 weights, not fp8");
    check_two_level_params(scales, zeros, *super_scales, super_mins, n, groups);
  } else {
    TORCH_CHECK(!super_mins, op, ": super_mins needs super_scales");
    check_quantized_params("scales", scales, n, groups, scales.scalar_type());
  }
  if (zeros && !super_scales) {
    TORCH_CHECK(format != cpu::QuantFormat::kFp8E4M3, op, ": fp8 weights take no zeros");
    check_quantized_params("zeros", *zeros, n, groups, scales.scalar_type(),
                           /*one_for_all=*/true);
  }
  if (bias) {
    check_like(op, "bias", *bias, input);
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous(), op,
                ": bias must be contiguous [", n, "]");
  }
  for (const std::optional<at::Tensor>& t : {std::optional<at::Tensor>(qweight),
                                             std::optional<at::Tensor>(scales), zeros,
                                             super_scales, super_mins}) {
    TORCH_CHECK(!t || t->device() == input.device(), op,
                ": qweight, scales, zeros, super_scales and super_mins must be on the input's "
                "device");
  }
  return format;
}

}  // namespace kvserve::ops
