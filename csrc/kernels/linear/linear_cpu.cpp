// CPU launcher for linear: the streaming GEMV kernels for a few tokens (on the plain weight or on
// oneDNN's packed one), oneDNN's GEMM on the packed weight otherwise (ATen's GEMM on a plain
// one), linear_prepack that packs a weight and checks that the GEMV can read it, and
// linear_gather_rows for tied embeddings.
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>

#include "kernels/cpu_dispatch.h"
#include "kernels/cpu_kernels.h"
#include "kernels/linear/linear.h"
#include "kernels/linear/linear_packed_layout.h"
#include "kernels/linear/linear_checks.h"
#include "kernels/op_checks.h"

// Raw access to an MKLDNN (oneDNN) tensor's buffer; exported by libtorch_cpu for AOTInductor,
// declared in a header (ATen/native/mkldnn/MKLDNNCommon.h) that the wheel does not ship.
namespace at::native {
TORCH_API void* data_ptr_from_mkldnn(const at::Tensor& mkldnn_tensor);
TORCH_API int64_t nbytes_from_mkldnn(const at::Tensor& mkldnn_tensor);
}  // namespace at::native

namespace kvserve::ops {
namespace {

// Up to this many tokens the GEMV kernel wins: it reads the weight once per token block and its
// time is the weight's bytes over memory bandwidth. Against ATen's GEMM, which repacks the weight
// on every call (MKL's small-M one runs on one core here), it wins up to 8 tokens. Over oneDNN's
// packed fp32 layout a thread streams each block of outputs once and keeps up to 8 tokens in
// registers per pass on AVX-512 (6 for 64-output blocks), re-reading the block from L2 for the
// next tokens: oneDNN's GEMM on the same weight takes 1.1-1.9x its time at the 5-9 tokens of a
// speculative verification and 1.0-1.2x at 16 (an Emerald Rapids VM, benchmarks/bench_linear.py).
// With AVX2's 16 registers (2-4 tokens a pass) it wins up to 4 tokens once the weight is over
// kSmallWeightBytes (1.2-1.5x at 3-4). In bf16 it wins only up to 2 tokens once the weight is
// over kSmallWeightBytes, where oneDNN's kernel converts faster; below, oneDNN's cost per call
// outweighs what the GEMV loses by reading the weight again per token block.
constexpr int64_t kMaxGemvTokens = 8;
constexpr int64_t kMaxGemvTokensPackedFp32 = 16;
constexpr int64_t kMaxGemvTokensPackedFp32Avx2 = 4;
constexpr int64_t kMaxGemvTokensPackedBf16 = 2;
// Where the CPU has no bf16 / fp16 GEMM, the GEMV (a pass over the weight per 4 tokens) beats
// converting the weight to fp32 for a GEMM up to ~32 tokens ([5632, 2048] bf16 on the AVX2 VM:
// 6.7 against 13.9 ms at 16 tokens, 11.3 against 17.7 at 32).
constexpr int64_t kMaxGemvTokensNoNativeGemm = 32;
constexpr int64_t kSmallWeightBytes = 4 << 20;
// fp32 bytes of weight rows converted per GEMM call on a CPU without a bf16 / fp16 GEMM.
constexpr int64_t kUpcastBlockBytes = 4 << 20;

bool packable(at::ScalarType dtype) { return dtype == at::kFloat || dtype == at::kBFloat16; }

int64_t pair_of(at::ScalarType dtype) { return dtype == at::kBFloat16 ? 2 : 1; }

// The layout of a packed weight (as linear_prepack made it), from its size.
std::optional<PackedLayout> layout_of(const at::Tensor& packed) {
  const int64_t numel = at::native::nbytes_from_mkldnn(packed) /
                        static_cast<int64_t>(packed.element_size());
  return packed_layout(packed.size(0), packed.size(1), pair_of(packed.scalar_type()), numel);
}

// True when every element of `weight` sits where `layout` says in the packed buffer (bit-exact).
template <typename T>
bool layout_matches(const at::Tensor& weight, const void* packed, const PackedLayout& layout) {
  const T* w = weight.data_ptr<T>();
  const T* p = static_cast<const T*>(packed);
  const int64_t n = weight.size(0), k = weight.size(1);
  std::atomic<bool> ok{true};
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end && ok.load(std::memory_order_relaxed); ++o) {
      for (int64_t i = 0; i < k; ++i) {
        if (std::memcmp(&w[o * k + i], &p[layout.offset(o, i)], sizeof(T)) != 0) {
          ok = false;
          break;
        }
      }
    }
  });
  return ok;
}

// A bf16 / fp16 projection on a CPU that has no GEMM for that dtype: blocks of weight rows
// converted to fp32 (a few MiB, which stay in cache while the GEMM reads them) and fp32 GEMMs,
// one rounding of the fp32 sums to the output dtype.
at::Tensor fp32_linear(const at::Tensor& input, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias) {
  const int64_t n = weight.size(0), k = weight.size(1);
  at::Tensor out = at::empty({input.size(0), n}, input.options());
  const at::Tensor x = input.to(at::kFloat);
  const int64_t rows = std::max<int64_t>(16, kUpcastBlockBytes / (4 * k));
  for (int64_t r = 0; r < n; r += rows) {
    const int64_t count = std::min(rows, n - r);
    const std::optional<at::Tensor> part =
        bias ? std::optional<at::Tensor>(bias->narrow(0, r, count).to(at::kFloat)) : std::nullopt;
    out.narrow(1, r, count).copy_(at::linear(x, weight.narrow(0, r, count).to(at::kFloat), part));
  }
  return out;
}

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
  const at::Tensor plain = weight.contiguous();
  at::Tensor packed;
  try {
    packed = op.call(plain, std::nullopt);
  } catch (const c10::Error&) {
    return at::Tensor();  // e.g. bf16 on a CPU without AVX-512: ATen's GEMM it is
  }
  const std::optional<PackedLayout> layout = layout_of(packed);
  const void* data = at::native::data_ptr_from_mkldnn(packed);
  const bool readable =
      layout && (plain.scalar_type() == at::kFloat ? layout_matches<float>(plain, data, *layout)
                                                   : layout_matches<c10::BFloat16>(plain, data, *layout));
  return readable ? packed : at::Tensor();
}

at::Tensor linear_cpu(const at::Tensor& input, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "linear";
  check_linear(input, weight, bias);
  const int64_t m = input.size(0), n = weight.size(0), k = weight.size(1);
  const bool packed = weight.is_mkldnn();
  std::optional<PackedLayout> layout;
  if (packed) {
    layout = layout_of(weight);
    TORCH_CHECK(layout && packable(weight.scalar_type()), op,
                ": a packed weight must come from linear_prepack");
  } else {
    check_like(op, "weight", weight, input);
  }
  const bool big = weight.numel() * static_cast<int64_t>(weight.element_size()) > kSmallWeightBytes;
  int64_t max_gemv = kMaxGemvTokens;
  if (packed && input.scalar_type() == at::kFloat &&
      cpu::cpu_capability() >= cpu::Capability::kAvx512) {
    max_gemv = kMaxGemvTokensPackedFp32;
  } else if (packed && big) {
    max_gemv = input.scalar_type() == at::kFloat ? kMaxGemvTokensPackedFp32Avx2
                                                 : kMaxGemvTokensPackedBf16;
  } else if (!packed && !cpu::has_native_gemm(input.scalar_type())) {
    max_gemv = kMaxGemvTokensNoNativeGemm;
  }
  const bool gemv_dtype = input.scalar_type() == at::kFloat ||
                          input.scalar_type() == at::kBFloat16 ||
                          (!packed && input.scalar_type() == at::kHalf);
  if (m == 0 || n == 0) return at::empty({m, n}, input.options());
  if (m > max_gemv || !gemv_dtype || (!packed && !weight.is_contiguous())) {
    if (packed) return onednn_linear(input, weight, bias);
    return cpu::has_native_gemm(weight.scalar_type()) ? at::linear(input, weight, bias)
                                                      : fp32_linear(input, weight, bias);
  }
  at::Tensor out = at::empty({m, n}, input.options());
  const void* bias_data = bias ? bias->data_ptr() : nullptr;
  if (packed) {
    cpu::gemv_packed_stub.get()(input.scalar_type(), input.data_ptr(), input.stride(0),
                                at::native::data_ptr_from_mkldnn(weight), bias_data,
                                out.data_ptr(), m, n, k, layout->block_out, layout->k_padded);
  } else {
    cpu::gemv_stub.get()(input.scalar_type(), input.data_ptr(), input.stride(0), weight.data_ptr(),
                         bias_data, out.data_ptr(), m, n, k);
  }
  return out;
}

// Rows of a packed weight: each element of a row sits in its own block column (strided reads).
template <typename T>
void gather_packed_rows(const T* packed, const PackedLayout& layout, const int64_t* ids,
                        int64_t rows, int64_t k, int64_t n, T* out) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      TORCH_CHECK(ids[r] >= 0 && ids[r] < n, "linear_gather_rows: id ", ids[r],
                  " is outside [0, ", n, ")");
      for (int64_t i = 0; i < k; ++i) out[r * k + i] = packed[layout.offset(ids[r], i)];
    }
  });
}

at::Tensor linear_gather_rows_cpu(const at::Tensor& weight, const at::Tensor& ids) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong,
              "linear_gather_rows: ids must be int64 [T]");
  if (!weight.is_mkldnn()) return weight.index_select(0, ids);
  const std::optional<PackedLayout> layout = layout_of(weight);
  TORCH_CHECK(layout && packable(weight.scalar_type()),
              "linear_gather_rows: a packed weight must come from linear_prepack");
  const at::Tensor index = ids.contiguous();
  const int64_t rows = index.size(0), n = weight.size(0), k = weight.size(1);
  at::Tensor out = at::empty({rows, k}, at::TensorOptions().dtype(weight.scalar_type()));
  const void* data = at::native::data_ptr_from_mkldnn(weight);
  if (weight.scalar_type() == at::kFloat) {
    gather_packed_rows(static_cast<const float*>(data), *layout, index.data_ptr<int64_t>(), rows,
                       k, n, out.data_ptr<float>());
  } else {
    gather_packed_rows(static_cast<const c10::BFloat16*>(data), *layout,
                       index.data_ptr<int64_t>(), rows, k, n, out.data_ptr<c10::BFloat16>());
  }
  return out;
}

}  // namespace

int64_t linear_weight_nbytes(const at::Tensor& weight) {
  return weight.is_mkldnn() ? at::native::nbytes_from_mkldnn(weight)
                            : static_cast<int64_t>(weight.nbytes());
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("linear", &linear_cpu);
  m.impl("linear_prepack", &linear_prepack_cpu);
  m.impl("linear_gather_rows", &linear_gather_rows_cpu);
}

// A packed weight is an MKLDNN tensor, whose dispatch key outranks CPU's.
TORCH_LIBRARY_IMPL(kvserve, MkldnnCPU, m) {
  m.impl("linear", &linear_cpu);
  m.impl("linear_gather_rows", &linear_gather_rows_cpu);
}

}  // namespace kvserve::ops
