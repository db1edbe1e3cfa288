// CUDA launcher for fused_moe_quantized: the shared checks, the experts' pointers (packed
// weights, scales, zeros) uploaded as one table, then the body's two passes. The ids stay on the
// device (reading them would synchronise); the body skips one outside [0, num_experts), where
// the CPU launcher throws.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "kernels/cuda_launch.h"
#include "kernels/moe/fused_moe_quantized.h"
#include "kernels/moe/fused_moe_quantized_checks.h"
#include "kernels/moe/fused_moe_quantized_kernel.cuh"

namespace kvserve::ops {
namespace {

constexpr const char* kFusedMoeQuantized = "fused_moe_quantized";
constexpr int kFusedMoeQuantizedWarps = 4;

// One projection's lists, and where its pointers sit in the table.
struct Projection {
  at::TensorList q, scales, zeros;
  int64_t group_size;
  cpu::QuantFormat format;
  int64_t offset = 0;   // q pointers at table[offset], scales after, zeros after those
  bool aligned = true;   // every q starts at a multiple of 4 and its rows are whole words
  bool aligned16 = true;  // every q starts at a multiple of 16
};

// Whether the body reads p's rows (k inputs) by 16-byte vectors, with inputs x rows of
// x_stride_bytes.
template <cuda::QuantFormat F>
bool vectors(const Projection& p, const void* x, int64_t x_stride_bytes, int64_t k) {
  constexpr int kInputs = cuda::kVectorInputs<F>;
  return p.aligned16 && k % kInputs == 0 && p.group_size % kInputs == 0 &&
         reinterpret_cast<uintptr_t>(x) % 16 == 0 && x_stride_bytes % 16 == 0;
}

// The pointers of both projections (zeros: null when the list is empty) on `device`: written to
// pinned memory and copied without synchronising (the caching host allocator keeps the buffer
// until the copy has run).
at::Tensor device_pointers(Projection& p13, Projection& p2, int64_t num_experts,
                           const at::Device& device) {
  std::vector<const void*> table(6 * num_experts);
  for (Projection* p : {&p13, &p2}) {
    p->offset = p == &p13 ? 0 : 3 * num_experts;
    for (int64_t e = 0; e < num_experts; ++e) {
      table[p->offset + e] = p->q[e].data_ptr();
      table[p->offset + num_experts + e] = p->scales[e].data_ptr();
      table[p->offset + 2 * num_experts + e] = p->zeros.empty() ? nullptr : p->zeros[e].data_ptr();
      const auto address = reinterpret_cast<uintptr_t>(p->q[e].data_ptr());
      p->aligned = p->aligned && address % 4 == 0;
      p->aligned16 = p->aligned16 && address % 16 == 0;
    }
    p->aligned = p->aligned && p->q[0].size(1) % 4 == 0;  // row bytes
  }
  return cuda::pointer_table(table, device);
}

template <typename T, cuda::QuantFormat F, typename P>
void gate_up(const at::Tensor& hidden, const int64_t* table, const Projection& p,
             const at::Tensor& topk_ids, int64_t num_experts, int64_t inter, bool gated,
             at::Tensor& act) {
  const int64_t k = topk_ids.size(1);
  const dim3 grid(act.size(0), cuda::blocks_for(inter, kFusedMoeQuantizedWarps));
  const int64_t* t = table + p.offset;
  cuda::moe_quantized_gate_up_kernel<T, F, P><<<grid, 32 * kFusedMoeQuantizedWarps, 0,
                                                cuda::current_stream()>>>(
      static_cast<const T*>(hidden.data_ptr()), hidden.stride(0),
      reinterpret_cast<const uint8_t* const*>(t),
      reinterpret_cast<const P* const*>(t + num_experts),
      reinterpret_cast<const P* const*>(t + 2 * num_experts), p.aligned,
      vectors<F>(p, hidden.data_ptr(), hidden.stride(0) * hidden.element_size(), hidden.size(1)),
      topk_ids.data_ptr<int64_t>(), k, num_experts, hidden.size(1), inter, p.group_size, gated,
      act.data_ptr<float>());
  KVSERVE_CUDA_CHECK_LAUNCH();
}

template <typename T, cuda::QuantFormat F, typename P>
void down_combine(const at::Tensor& act, const int64_t* table, const Projection& p,
                  const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                  int64_t num_experts, at::Tensor& out) {
  const int64_t hidden_size = out.size(1);
  const dim3 grid(out.size(0), cuda::blocks_for(hidden_size, kFusedMoeQuantizedWarps));
  const int64_t* t = table + p.offset;
  cuda::moe_quantized_down_combine_kernel<T, F, P><<<grid, 32 * kFusedMoeQuantizedWarps, 0,
                                                     cuda::current_stream()>>>(
      act.data_ptr<float>(), reinterpret_cast<const uint8_t* const*>(t),
      reinterpret_cast<const P* const*>(t + num_experts),
      reinterpret_cast<const P* const*>(t + 2 * num_experts), p.aligned,
      vectors<F>(p, act.data_ptr(), act.stride(0) * act.element_size(), act.size(1)),
      topk_ids.data_ptr<int64_t>(), topk_weights.data_ptr<float>(), topk_ids.size(1),
      num_experts, hidden_size, act.size(1), p.group_size, static_cast<T*>(out.data_ptr()));
  KVSERVE_CUDA_CHECK_LAUNCH();
}

// Calls f(Format<F>{}) with F the body's format for `format`.
template <cuda::QuantFormat F>
struct Format {
  static constexpr cuda::QuantFormat value = F;
};
template <typename Fn>
void dispatch_format(cpu::QuantFormat format, Fn&& f) {
  switch (format) {
    case cpu::QuantFormat::kInt8: f(Format<cuda::QuantFormat::kInt8>{}); break;
    case cpu::QuantFormat::kInt4: f(Format<cuda::QuantFormat::kInt4>{}); break;
    case cpu::QuantFormat::kFp8E4M3: f(Format<cuda::QuantFormat::kFp8E4M3>{}); break;
  }
}

at::Tensor fused_moe_quantized_cuda(const at::Tensor& hidden, at::TensorList w13,
                                    at::TensorList w13_scales, at::TensorList w13_zeros,
                                    int64_t w13_group_size, at::TensorList w2,
                                    at::TensorList w2_scales, at::TensorList w2_zeros,
                                    int64_t w2_group_size, const at::Tensor& topk_weights,
                                    const at::Tensor& topk_ids, c10::string_view activation) {
  const auto [format13, format2, inter] =
      check_fused_moe_quantized(hidden, w13, w13_scales, w13_zeros, w13_group_size, w2,
                                w2_scales, w2_zeros, w2_group_size, topk_weights, topk_ids,
                                activation);
  const bool gated = activation == "silu";
  const int64_t num_tokens = hidden.size(0), hidden_size = hidden.size(1);
  const int64_t num_experts = static_cast<int64_t>(w13.size()), k = topk_ids.size(1);
  at::Tensor out = at::empty({num_tokens, hidden_size}, hidden.options());
  if (out.numel() == 0) return out;
  if (k == 0 || inter == 0) return out.zero_();  // no expert adds anything
  const c10::cuda::CUDAGuard guard(hidden.device());
  Projection p13{w13, w13_scales, w13_zeros, w13_group_size, format13};
  Projection p2{w2, w2_scales, w2_zeros, w2_group_size, format2};
  const at::Tensor pointers = device_pointers(p13, p2, num_experts, hidden.device());
  const int64_t* table = pointers.data_ptr<int64_t>();
  at::Tensor act = at::empty({num_tokens * k, inter}, hidden.options().dtype(at::kFloat));
  cuda::dispatch_float(hidden.scalar_type(), kFusedMoeQuantized, [&](auto type) {
    using T = typename decltype(type)::type;
    dispatch_format(format13, [&](auto f) {
      constexpr cuda::QuantFormat F = decltype(f)::value;
      if (w13_scales[0].scalar_type() == at::kHalf) {
        gate_up<T, F, __half>(hidden, table, p13, topk_ids, num_experts, inter, gated, act);
      } else {
        gate_up<T, F, float>(hidden, table, p13, topk_ids, num_experts, inter, gated, act);
      }
    });
    dispatch_format(format2, [&](auto f) {
      constexpr cuda::QuantFormat F = decltype(f)::value;
      if (w2_scales[0].scalar_type() == at::kHalf) {
        down_combine<T, F, __half>(act, table, p2, topk_ids, topk_weights, num_experts, out);
      } else {
        down_combine<T, F, float>(act, table, p2, topk_ids, topk_weights, num_experts, out);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvserve, CUDA, m) { m.impl("fused_moe_quantized", &fused_moe_quantized_cuda); }

}  // namespace kvserve::ops
