#pragma once
// Argument checks shared by the op launchers. Every failure is a c10::Error (a Python
// RuntimeError) that names the op and the argument.

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>

#include "kernels/cpu_kernels.h"

namespace kvserve::ops {

/// Checks that t is on the CPU, has `dim` dimensions and a contiguous last dimension.
inline void check_rows(const char* op, const char* name, const at::Tensor& t, int64_t dim) {
  TORCH_CHECK(t.dim() == dim, op, ": ", name, " must have ", dim, " dimensions, got ", t.sizes());
  TORCH_CHECK(t.stride(-1) == 1 || t.size(-1) == 1, op, ": ", name,
              " must be contiguous in its last dimension");
}

/// Checks that t has the same dtype and device as ref.
inline void check_like(const char* op, const char* name, const at::Tensor& t, const at::Tensor& ref) {
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), op, ": ", name, " has dtype ", t.scalar_type(),
              ", expected ", ref.scalar_type());
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " is on ", t.device(), ", expected ",
              ref.device());
}

/// Checks that t is a contiguous tensor of the given dtype.
inline void check_contiguous(const char* op, const char* name, const at::Tensor& t,
                             at::ScalarType dtype) {
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

/// Checks the arguments of a gated activation (silu_and_mul, gelu_tanh_and_mul): input [T, 2d]
/// and out [T, d], one dtype, rows contiguous.
inline void check_gated_activation(const char* op, const at::Tensor& out, const at::Tensor& input) {
  check_rows(op, "input", input, 2);
  check_rows(op, "out", out, 2);
  check_like(op, "out", out, input);
  TORCH_CHECK(input.size(1) % 2 == 0 && out.size(0) == input.size(0) &&
                  out.size(1) == input.size(1) / 2,
              op, ": expected input [T, 2d] and out [T, d], got ", input.sizes(), " and ",
              out.sizes());
}

/// Checks an RMSNorm's input [T, hidden] and weight [hidden] (the input's dtype or fp32).
inline void check_norm_weight(const char* op, const at::Tensor& x, const at::Tensor& weight) {
  check_rows(op, "input", x, 2);
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() || weight.scalar_type() == at::kFloat, op,
              ": weight must have input's dtype ", x.scalar_type(), " or be float32, got ",
              weight.scalar_type());
  TORCH_CHECK(weight.device() == x.device(), op, ": weight is on ", weight.device(),
              ", expected ", x.device());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(), op,
              ": weight must be contiguous [", x.size(1), "], got ", weight.sizes());
}

/// The format of a KV cache (contract: kernels/cache/kv_cache_write.h) that holds entries of
/// `dtype`: plain when the cache is of `dtype` (then `scale` must be absent); int8 / fp8 E4M3 with
/// `scale` fp32 contiguous [num_blocks, block_size, num_kv_heads], one per row, on its device.
inline cpu::KVCacheFormat check_kv_cache_format(const char* op, const char* name,
                                                const at::Tensor& cache, at::ScalarType dtype,
                                                const std::optional<at::Tensor>& scale) {
  const at::ScalarType c = cache.scalar_type();
  if (c == dtype) {
    TORCH_CHECK(!scale.has_value(), op, ": ", name, " holds ", dtype,
                " entries and takes no scales");
    return cpu::KVCacheFormat::kPlain;
  }
  TORCH_CHECK(c == at::kChar || c == at::kFloat8_e4m3fn, op, ": ", name,
              " must have the entries' dtype ", dtype, " or be int8 / float8_e4m3fn, got ", c);
  TORCH_CHECK(scale.has_value(), op, ": the ", c, " ", name, " needs its scales");
  const at::Tensor& s = *scale;
  TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() && s.dim() == 3 &&
                  s.sizes() == cache.sizes().slice(0, 3) && s.device() == cache.device(),
              op, ": the scales of ", name, " must be contiguous fp32 ",
              cache.sizes().slice(0, 3), " on its device, got ", s.scalar_type(), " ", s.sizes());
  return c == at::kChar ? cpu::KVCacheFormat::kInt8 : cpu::KVCacheFormat::kFp8E4M3;
}

}  // namespace kvserve::ops
