// CPU launcher for quantized_linear: the quantized GEMV for a few tokens (the integer one with
// quantize_input); for more, blocks of weight rows dequantized and handed to ATen's GEMM (in the
// input dtype where the CPU multiplies it natively, else in fp32).
#include <ATen/ops/empty.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <algorithm>

#include "kernels/cpu_dispatch.h"
#include "kernels/cpu_kernels.h"
#include "kernels/linear/quantized_linear.h"
#include "kernels/linear/quantized_linear_checks.h"

namespace kvserve::ops {
namespace {

// Up to this many tokens the GEMV, which reads the packed weight once per four tokens, wins over
// dequantizing the weight for a GEMM (benchmarks/bench_quant.py).
constexpr int64_t kMaxGemvTokens = 8;
// With bf16 / fp16 input on a CPU without a GEMM for it, the GEMM runs in fp32 after converting
// the input and the weight blocks, and the GEMV wins up to ~32 tokens (int8 [5632, 2048] on the
// AVX2 VM: 6.6 against 16.0 ms at 16 tokens, 10.4 against 19.6 at 32).
constexpr int64_t kMaxGemvTokensNoNativeGemm = 32;
// Rows dequantized per GEMM call: a few MiB of fp32 that stay in cache while the GEMM reads them.
constexpr int64_t kDequantBlockBytes = 4 << 20;

at::Tensor quantized_linear_cpu(const at::Tensor& input, const at::Tensor& qweight,
                                const at::Tensor& scales, const std::optional<at::Tensor>& zeros,
                                int64_t group_size, const std::optional<at::Tensor>& bias,
                                bool quantize_input,
                                const std::optional<at::Tensor>& super_scales,
                                const std::optional<at::Tensor>& super_mins) {
  const cpu::QuantFormat format = check_quantized_linear(
      input, qweight, scales, zeros, group_size, bias, quantize_input, super_scales, super_mins);
  const at::ScalarType dtype = input.scalar_type();
  const int64_t m = input.size(0), k = input.size(1), n = qweight.size(0);
  at::Tensor out = at::empty({m, n}, input.options());
  if (m == 0 || n == 0) return out;
  const at::ScalarType params = super_scales ? super_scales->scalar_type() : scales.scalar_type();
  const cpu::QuantizedWeight w{format,
                               qweight.data_ptr(),
                               scales.data_ptr(),
                               zeros ? zeros->data_ptr() : nullptr,
                               params == at::kHalf,
                               n,
                               k,
                               group_size,
                               is_shared_zero(zeros),
                               super_scales ? super_scales->data_ptr() : nullptr,
                               super_mins ? super_mins->data_ptr() : nullptr,
                               super_scales ? scales.size(1) / super_scales->size(1) : 0};
  // With quantize_input, the integer kernels take as many tokens as they are fast for (32 for
  // the vector ones, which read the weight once per four tokens; any number in AMX tiles); more
  // round the input and take the GEMM.
  if (quantize_input && m <= cpu::quantized_int8_input_tokens_stub.get()(w)) {
    cpu::quantized_gemv_int8_input_stub.get()(dtype, input.data_ptr(), input.stride(0), w,
                                              bias ? bias->data_ptr() : nullptr, out.data_ptr(),
                                              m);
    return out;
  }
  if (!quantize_input &&
      m <= (cpu::has_native_gemm(dtype) ? kMaxGemvTokens : kMaxGemvTokensNoNativeGemm)) {
    cpu::quantized_gemv_stub.get()(dtype, input.data_ptr(), input.stride(0), w,
                                   bias ? bias->data_ptr() : nullptr, out.data_ptr(), m);
    return out;
  }
  // The dequantized rows come in the order the kernels unpack them; the input's columns follow.
  at::Tensor order = at::empty({k}, input.options().dtype(at::kLong));
  cpu::quantized_order_stub.get()(w, order.data_ptr<int64_t>());
  // The GEMM runs in the input's dtype where the CPU multiplies it natively, else in fp32.
  const at::ScalarType gemm = cpu::has_native_gemm(dtype) ? dtype : at::kFloat;
  const at::Tensor source = quantize_input ? round_input_to_int8_blocks(input, group_size) : input;
  const at::Tensor x = source.index_select(1, order).to(gemm);
  const int64_t rows = std::max<int64_t>(16, kDequantBlockBytes / (4 * k));
  at::Tensor block = at::empty({std::min(rows, n), k}, input.options().dtype(at::kFloat));
  for (int64_t r = 0; r < n; r += rows) {
    const int64_t count = std::min(rows, n - r);
    at::Tensor plain = block.narrow(0, 0, count);
    cpu::quantized_dequantize_stub.get()(w, r, r + count, plain.data_ptr<float>());
    const std::optional<at::Tensor> part =
        bias ? std::optional<at::Tensor>(bias->narrow(0, r, count).to(gemm)) : std::nullopt;
    out.narrow(1, r, count).copy_(at::linear(x, plain.to(gemm), part));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("quantized_linear", &quantized_linear_cpu); }

}  // namespace kvserve::ops
