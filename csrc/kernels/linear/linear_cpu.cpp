// CPU launcher for linear: the streaming GEMV kernel for a few tokens, oneDNN's GEMM on the
// packed weight otherwise (ATen's GEMM when there is none), and linear_prepack that packs it.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include "kernels/cpu_kernels.h"
#include "kernels/linear/linear.h"
#include "kernels/op_checks.h"

namespace kvserve::ops {
namespace {

// Up to this many tokens the GEMV kernel wins: it reads the weight once per kTokenBlock tokens
// and its time is the weight's bytes over memory bandwidth. Against ATen's GEMM, which repacks
// the weight on every call (MKL's small-M one runs on one core here), it wins up to 8 tokens;
// against oneDNN on a packed weight only up to 2 (benchmarks/bench_linear.py), once the weight
// is bigger than kSmallWeightBytes. Below that, oneDNN's cost per call (tens of microseconds
// in a model's step) outweighs what the GEMV loses by reading the weight again per 4 tokens: the
// shipped 6.8M model decodes 3 sequences in 1.25 ms per step this way and in 1.5 ms on oneDNN,
// while the ~100M Llama decodes 8 in 19 ms on oneDNN and in 34 ms with the GEMV.
constexpr int64_t kMaxGemvTokens = 8;
constexpr int64_t kMaxGemvTokensPacked = 2;
constexpr int64_t kSmallWeightBytes = 4 << 20;

bool packable(at::ScalarType dtype) { return dtype == at::kFloat || dtype == at::kBFloat16; }

// oneDNN's linear (mkldnn::_linear_pointwise, registered by torch) on a weight packed by
// mkldnn::_reorder_linear_weight: the blocked layout its GEMM reads directly, so no call spends
// time repacking the weight.
at::Tensor onednn_linear(const at::Tensor& input, const at::Tensor& packed,
                         const std::optional<at::Tensor>& bias) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            c10::string_view, c10::List<std::optional<at::Scalar>>,
                            std::optional<c10::string_view>)>();
  return op.call(input, packed, bias, "none", c10::List<std::optional<at::Scalar>>(),
                 std::nullopt);
}

at::Tensor linear_prepack_cpu(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "linear_prepack: weight must be [out, in], got ", weight.sizes());
  if (!packable(weight.scalar_type()) || weight.numel() == 0 || !at::hasMKLDNN() ||
      !at::globalContext().userEnabledMkldnn())
    return at::Tensor();
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mkldnn::_reorder_linear_weight", "")
                             .typed<at::Tensor(const at::Tensor&, std::optional<int64_t>)>();
  try {
    return op.call(weight.contiguous(), std::nullopt);
  } catch (const c10::Error&) {
    return at::Tensor();  // e.g. bf16 on a CPU without AVX-512: ATen's GEMM it is
  }
}

at::Tensor linear_cpu(const at::Tensor& input, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias,
                      const std::optional<at::Tensor>& packed_weight) {
  constexpr const char* op = "linear";
  check_rows(op, "input", input, 2);
  check_like(op, "weight", weight, input);
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == input.size(1), op, ": weight must be [out, ",
              input.size(1), "], got ", weight.sizes());
  const int64_t m = input.size(0), n = weight.size(0), k = weight.size(1);
  if (bias) {
    check_like(op, "bias", *bias, input);
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous(), op,
                ": bias must be contiguous [", n, "]");
  }
  const bool packed = packed_weight && packed_weight->defined();
  if (packed) {
    TORCH_CHECK(packed_weight->is_mkldnn() && packed_weight->scalar_type() == input.scalar_type() &&
                    packed_weight->sizes() == weight.sizes(),
                op, ": packed_weight must come from linear_prepack of this weight");
  }
  const bool big_packed = packed && weight.nbytes() > static_cast<size_t>(kSmallWeightBytes);
  const bool small = m <= (big_packed ? kMaxGemvTokensPacked : kMaxGemvTokens) &&
                     weight.is_contiguous() &&
                     (input.scalar_type() == at::kFloat || input.scalar_type() == at::kBFloat16 ||
                      input.scalar_type() == at::kHalf);
  if (m == 0 || n == 0) return at::linear(input, weight, bias);
  if (!small) {
    return packed ? onednn_linear(input, *packed_weight, bias) : at::linear(input, weight, bias);
  }
  at::Tensor out = at::empty({m, n}, input.options());
  cpu::gemv_stub.get()(input.scalar_type(), input.data_ptr(), input.stride(0), weight.data_ptr(),
                       bias ? bias->data_ptr() : nullptr, out.data_ptr(), m, n, k);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("linear", &linear_cpu);
  m.impl("linear_prepack", &linear_prepack_cpu);
}

// A packed weight is an MKLDNN tensor, whose dispatch key outranks CPU's.
TORCH_LIBRARY_IMPL(kvserve, MkldnnCPU, m) { m.impl("linear", &linear_cpu); }

}  // namespace kvserve::ops
