#pragma once
// Which CUDA body runs quantized_linear, chosen per process: the fastest that applies by default;
// KVSERVE_QUANTIZED_LINEAR_KERNEL (read at the first call) or set_quantized_linear_kernel
// narrows it, for benchmarks that compare the bodies in one run and for bisecting a wrong result
// on a GPU.

#include <string>

namespace kvserve::ops {

/// auto: the GEMV for one token, tensor cores (quantized_linear_mma_kernel.cuh) for bf16 / fp16
/// inputs up to 64 tokens, blocks of rows dequantized for the device's GEMM beyond;
/// mma: tensor cores for any number of tokens where they apply; wide: the tensor-core body in
/// blocks of 128-256 rows that share staged inputs (quantized_linear_wide_kernel.cuh) for any
/// number of tokens, not yet timed on a GPU and so not auto's choice; gemv: the GEMV up to 8
/// tokens, the dequantizing GEMM beyond (the bodies before tensor cores); dequantize: always the
/// dequantizing GEMM. A body that does not apply (fp32 inputs, unaligned data) falls back as
/// auto does.
enum class QuantizedLinearKernel { kAuto, kMma, kGemv, kDequantize, kWide };

/// The current choice (KVSERVE_QUANTIZED_LINEAR_KERNEL at first use, then the last
/// set_quantized_linear_kernel).
QuantizedLinearKernel quantized_linear_kernel();

/// Sets the choice by name (auto, mma, gemv, dequantize, wide); throws std::invalid_argument
/// otherwise.
void set_quantized_linear_kernel(const std::string& name);

/// The current choice's name.
std::string quantized_linear_kernel_name();

}  // namespace kvserve::ops
