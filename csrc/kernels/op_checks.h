#pragma once
// Argument checks shared by the op launchers. Every failure is a c10::Error (a Python
// RuntimeError) that names the op and the argument.

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>

#include "kernels/cpu_kernels.h"

namespace kvserve::ops {

/// Throws the c10::Error "<op><message><value>". CUDA launchers report numbers through this (or
/// through the checks here, all compiled by the C++ compiler): in the CUDA build on an H200
/// machine (nvcc 13.0, torch 2.11), formatting a number in a TU compiled by nvcc crashed the
/// process inside libstdc++'s num_put instead of raising.
[[noreturn]] void fail_with_number(const char* op, const char* message, int64_t value);

/// Checks that t is on the CPU, has `dim` dimensions and a contiguous last dimension.
void check_rows(const char* op, const char* name, const at::Tensor& t, int64_t dim);

/// Checks that t has the same dtype and device as ref.
void check_like(const char* op, const char* name, const at::Tensor& t, const at::Tensor& ref);

/// Checks that t is a contiguous tensor of the given dtype.
void check_contiguous(const char* op, const char* name, const at::Tensor& t,
                      at::ScalarType dtype);

/// Checks the arguments of a gated activation (silu_and_mul, gelu_tanh_and_mul): input [T, 2d]
/// and out [T, d], one dtype, rows contiguous.
void check_gated_activation(const char* op, const at::Tensor& out, const at::Tensor& input);

/// Checks an RMSNorm's input [T, hidden] and weight [hidden] (the input's dtype or fp32).
void check_norm_weight(const char* op, const at::Tensor& x, const at::Tensor& weight);

/// The format of a KV cache (contract: kernels/cache/kv_cache_write.h) that holds entries of
/// `dtype`: plain when the cache is of `dtype` (then `scale` must be absent); int8 / fp8 E4M3 with
/// `scale` fp32 contiguous [num_blocks, block_size, num_kv_heads], one per row, on its device.
cpu::KVCacheFormat check_kv_cache_format(const char* op, const char* name,
                                         const at::Tensor& cache, at::ScalarType dtype,
                                         const std::optional<at::Tensor>& scale);

}  // namespace kvserve::ops
