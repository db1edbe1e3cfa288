#pragma once
// Argument checks of quantized_linear shared by its CPU and CUDA launchers (and by
// fused_moe_quantized's, which check each projection with them).

#include <ATen/core/Tensor.h>

#include <optional>

#include "kernels/cpu_kernels.h"
#include "kernels/op_checks.h"

namespace kvserve::ops {

/// The format qweight's dtype stores q in; throws for any other dtype.
cpu::QuantFormat quantized_format_of(const at::Tensor& qweight);

/// Checks scales or zeros: contiguous fp32 [n, groups].
void check_quantized_params(const char* name, const at::Tensor& t, int64_t n,
                            int64_t groups);

/// Every shape, dtype, device and group size of quantized_linear.h; returns qweight's format.
cpu::QuantFormat check_quantized_linear(const at::Tensor& input, const at::Tensor& qweight,
                                        const at::Tensor& scales,
                                        const std::optional<at::Tensor>& zeros,
                                        int64_t group_size,
                                        const std::optional<at::Tensor>& bias);

}  // namespace kvserve::ops
