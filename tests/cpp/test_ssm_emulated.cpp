// The state-space mixer's CUDA bodies run by the CUDA emulator (cuda_emulator.h) with their
// launchers' block sizes, against the CPU ops: ssm_scan's recurrent and chunked forms (Mamba's
// per-state decay: recurrent only), ssm_causal_conv1d and rms_norm_gated. Sequences of 0, 1, 3 tokens, exactly a chunk, and over
// two chunks in one batch, in permuted slots of a larger pool, some with an initial state;
// strided rows; sizes that are not powers of two; fp32 and model-dtype state pools; each dtype.
#include "cuda_emulator.h"

#include <ATen/ops/rand.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kernels/norm/rms_norm_gated.h"
#include "kernels/norm/rms_norm_gated_kernel.cuh"
#include "kernels/ssm/ssm_causal_conv1d.h"
#include "kernels/ssm/ssm_causal_conv1d_kernel.cuh"
#include "kernels/ssm/ssm_chunk_scan_kernel.cuh"
#include "kernels/ssm/ssm_scan.h"
#include "kernels/ssm/ssm_scan_kernel.cuh"
#include "tensor_values.h"

namespace kvserve {
namespace {

// The batch: sequence lengths, their slots in a pool of kSlots, which start from a state.
const std::vector<int32_t> kLengths = {3, 0, 1, cuda::kSsdChunk, 2 * cuda::kSsdChunk + 5, 7};
const std::vector<int32_t> kSlotsOf = {5, 0, 7, 2, 1, 4};
const std::vector<bool> kInitial = {true, true, false, true, false, false};
constexpr int64_t kSlots = 8;

struct Batch {
  at::Tensor cu_seqlens, slots, has_initial_state;
  int64_t num_tokens = 0, num_seqs = 0;
};

Batch make_batch() {
  Batch b;
  std::vector<int32_t> cu = {0};
  for (const int32_t n : kLengths) cu.push_back(cu.back() + n);
  b.num_tokens = cu.back();
  b.num_seqs = static_cast<int64_t>(kLengths.size());
  b.cu_seqlens = at::tensor(cu, at::kInt);
  b.slots = at::tensor(kSlotsOf, at::kInt);
  b.has_initial_state = at::tensor(std::vector<int32_t>(kInitial.begin(), kInitial.end()),
                                   at::kInt).to(at::kBool);
  return b;
}

// Rows of `cols` values in a wider buffer, as the mixer's projections give them.
at::Tensor strided_rows(int64_t rows, int64_t cols, at::ScalarType dtype, double scale = 1.0) {
  return at::randn({rows, cols + 5}).mul_(scale).to(dtype).narrow(1, 2, cols);
}

struct ScanCase {
  int64_t heads, groups, head_dim, state_size;
  bool softplus, with_d_and_bias;
  bool per_state = false;  // Mamba's A [heads, state_size]: the recurrent form alone
};

template <typename T, typename S>
void run_scan(at::ScalarType dtype, at::ScalarType state_type, const ScanCase& c,
              double tolerance) {
  SCOPED_TRACE(std::string(c10::toString(dtype)) + " state " + c10::toString(state_type) +
               " heads " + std::to_string(c.heads) + "/" + std::to_string(c.groups) + " P " +
               std::to_string(c.head_dim) + " N " + std::to_string(c.state_size));
  at::manual_seed(5);
  const Batch b = make_batch();
  const int64_t T_ = b.num_tokens, H = c.heads, P = c.head_dim, N = c.state_size;
  const at::Tensor x = strided_rows(T_, H * P, dtype).view({T_, H, P});
  const at::Tensor dt = strided_rows(T_, H, dtype);
  const at::Tensor B = strided_rows(T_, c.groups * N, dtype).view({T_, c.groups, N});
  const at::Tensor C = strided_rows(T_, c.groups * N, dtype).view({T_, c.groups, N});
  const at::Tensor A = (c.per_state ? at::rand({H, N}) : at::rand({H})).mul_(-2.0).sub_(0.1);
  const at::Tensor D = at::randn({H});
  const at::Tensor dt_bias = at::randn({H}).mul_(0.5);
  const std::optional<at::Tensor> d = c.with_d_and_bias ? std::optional<at::Tensor>(D)
                                                        : std::nullopt;
  const std::optional<at::Tensor> bias =
      c.with_d_and_bias ? std::optional<at::Tensor>(dt_bias) : std::nullopt;
  const double dt_min = 0.01, dt_max = 0.6;  // both bite on N(0, 1) inputs
  const at::Tensor pool = at::randn({kSlots, H, P, N}).to(state_type);

  at::Tensor expected = at::zeros({T_, H, P}).to(dtype);
  at::Tensor expected_state = pool.clone();
  ops::ssm_scan(expected, x, dt, A, B, C, d, bias, expected_state, b.cu_seqlens, b.slots,
                b.has_initial_state, c.softplus, dt_min, dt_max);

  for (const bool chunked : {false, true}) {
    if (chunked && c.per_state) continue;
    SCOPED_TRACE(chunked ? "chunked" : "recurrent");
    at::Tensor out = at::zeros({T_, H, P}).to(dtype);
    at::Tensor state = pool.clone();
    cuda::SsmScanParams<T, S> p{};
    p.out = static_cast<T*>(out.data_ptr());
    p.out_stride = out.stride(0);
    p.x = static_cast<const T*>(x.data_ptr());
    p.x_stride = x.stride(0);
    p.dt = static_cast<const T*>(dt.data_ptr());
    p.dt_stride = dt.stride(0);
    p.B = static_cast<const T*>(B.data_ptr());
    p.B_stride = B.stride(0);
    p.C = static_cast<const T*>(C.data_ptr());
    p.C_stride = C.stride(0);
    p.A = A.data_ptr<float>();
    p.A_per_state = c.per_state;
    p.D = c.with_d_and_bias ? D.data_ptr<float>() : nullptr;
    p.dt_bias = c.with_d_and_bias ? dt_bias.data_ptr<float>() : nullptr;
    p.state = static_cast<S*>(state.data_ptr());
    p.cu_seqlens = b.cu_seqlens.data_ptr<int32_t>();
    p.slots = b.slots.data_ptr<int32_t>();
    p.has_initial_state = b.has_initial_state.data_ptr<bool>();
    p.num_tokens = T_;
    p.num_slots = kSlots;
    p.heads = H;
    p.head_dim = P;
    p.groups = c.groups;
    p.state_size = N;
    p.dt_softplus = c.softplus;
    p.dt_min = static_cast<float>(dt_min);
    p.dt_max = static_cast<float>(dt_max);
    const dim3 grid(static_cast<unsigned>(H), static_cast<unsigned>(b.num_seqs));
    if (chunked) {
      emu::launch(cuda::ssm_chunk_scan_kernel<T, S>, grid, dim3(256),
                  cuda::ssm_chunk_scan_shared_floats(P, N) * sizeof(float), p);
    } else {
      emu::launch(cuda::ssm_scan_kernel<T, S>, grid, dim3(cuda::ssm_scan_threads(P)),
                  P * N * sizeof(float), p);
    }
    EXPECT_LE(test_util::worst_relative_error(expected, out), tolerance) << "outputs";
    EXPECT_LE(test_util::worst_relative_error(expected_state, state), tolerance) << "states";
  }
}

TEST(SsmScanEmulated, BothFormsMatchTheCpuOp) {
  const std::vector<ScanCase> cases = {{6, 3, 12, 10, true, true}, {4, 1, 16, 33, false, false},
                                       {2, 2, 5, 64, true, false},
                                       {37, 1, 1, 16, true, true, true},
                                       {5, 1, 3, 40, true, false, true}};
  for (const ScanCase& c : cases) {
    run_scan<float, float>(at::kFloat, at::kFloat, c, 1e-4);
    run_scan<__nv_bfloat16, float>(at::kBFloat16, at::kFloat, c, 2e-2);
    run_scan<__nv_bfloat16, __nv_bfloat16>(at::kBFloat16, at::kBFloat16, c, 2e-2);
    run_scan<__half, float>(at::kHalf, at::kFloat, c, 4e-3);
  }
}

template <typename T, typename S>
void run_conv(at::ScalarType dtype, at::ScalarType state_type, int64_t dim, int kernel,
              bool with_bias, bool silu, double tolerance) {
  SCOPED_TRACE(std::string(c10::toString(dtype)) + " state " + c10::toString(state_type) +
               " dim " + std::to_string(dim) + " kernel " + std::to_string(kernel));
  at::manual_seed(6);
  const Batch b = make_batch();
  const at::Tensor x = strided_rows(b.num_tokens, dim, dtype);
  const at::Tensor weight = at::randn({dim, kernel});
  const at::Tensor bias = at::randn({dim});
  const std::optional<at::Tensor> bias_arg =
      with_bias ? std::optional<at::Tensor>(bias) : std::nullopt;
  const at::Tensor pool = at::randn({kSlots, dim, kernel - 1}).to(state_type);
  at::Tensor expected = at::zeros({b.num_tokens, dim}).to(dtype);
  at::Tensor expected_state = pool.clone();
  ops::ssm_causal_conv1d(expected, x, weight, bias_arg, expected_state, b.cu_seqlens, b.slots,
                         b.has_initial_state, silu);
  at::Tensor out = at::zeros({b.num_tokens, dim}).to(dtype);
  at::Tensor state = pool.clone();
  constexpr int kThreads = 128;  // the launcher's
  emu::launch(cuda::ssm_causal_conv1d_kernel<T, S>,
              dim3(static_cast<unsigned>((dim + kThreads - 1) / kThreads),
                   static_cast<unsigned>(b.num_seqs)),
              dim3(kThreads), 0, static_cast<T*>(out.data_ptr()), out.stride(0),
              static_cast<const T*>(x.data_ptr()), x.stride(0), weight.data_ptr<float>(),
              with_bias ? bias.data_ptr<float>() : nullptr, static_cast<S*>(state.data_ptr()),
              b.cu_seqlens.data_ptr<int32_t>(), b.slots.data_ptr<int32_t>(),
              b.has_initial_state.data_ptr<bool>(), b.num_tokens, kSlots, dim, kernel, silu);
  EXPECT_LE(test_util::worst_relative_error(expected, out), tolerance) << "outputs";
  EXPECT_LE(test_util::worst_relative_error(expected_state, state), tolerance) << "states";
}

TEST(SsmCausalConv1dEmulated, MatchesTheCpuOp) {
  for (const int64_t dim : {1, 37, 130}) {
    for (const int kernel : {2, 4}) {
      run_conv<float, float>(at::kFloat, at::kFloat, dim, kernel, true, true, 1e-5);
      run_conv<float, float>(at::kFloat, at::kFloat, dim, kernel, false, false, 1e-5);
      run_conv<__nv_bfloat16, float>(at::kBFloat16, at::kFloat, dim, kernel, true, true, 1e-2);
      run_conv<__half, __half>(at::kHalf, at::kHalf, dim, kernel, true, false, 2e-3);
    }
  }
}

template <typename T>
void run_norm(at::ScalarType dtype, int64_t dim, int64_t group_size, bool with_gate,
              bool with_weight, bool norm_before_gate, double tolerance) {
  SCOPED_TRACE(std::string(c10::toString(dtype)) + " dim " + std::to_string(dim) + " group " +
               std::to_string(group_size) + (with_gate ? " gated" : "") +
               (with_weight ? " weighted" : "") + (norm_before_gate ? " norm first" : ""));
  at::manual_seed(7);
  const int64_t rows = 3;
  const at::Tensor x = strided_rows(rows, dim, dtype, 3.0);
  const at::Tensor gate = strided_rows(rows, dim, dtype);
  const at::Tensor weight = at::randn({dim});
  const std::optional<at::Tensor> g = with_gate ? std::optional<at::Tensor>(gate) : std::nullopt;
  const std::optional<at::Tensor> w =
      with_weight ? std::optional<at::Tensor>(weight) : std::nullopt;
  at::Tensor expected = at::zeros({rows, dim}).to(dtype);
  ops::rms_norm_gated(expected, x, g, w, group_size, 1e-5, norm_before_gate);
  at::Tensor out = at::zeros({rows, dim}).to(dtype);
  const int threads = static_cast<int>(std::min<int64_t>(512, (group_size + 31) / 32 * 32));
  emu::launch(cuda::rms_norm_gated_kernel<T>,
              dim3(static_cast<unsigned>(dim / group_size), static_cast<unsigned>(rows)),
              dim3(threads), 0, static_cast<T*>(out.data_ptr()), out.stride(0),
              static_cast<const T*>(x.data_ptr()), x.stride(0),
              with_gate ? static_cast<const T*>(gate.data_ptr()) : nullptr,
              with_gate ? gate.stride(0) : int64_t{0},
              with_weight ? weight.data_ptr<float>() : nullptr, group_size, 1e-5f,
              norm_before_gate);
  EXPECT_LE(test_util::worst_relative_error(expected, out), tolerance);
}

TEST(RmsNormGatedEmulated, MatchesTheCpuOpInEveryMode) {
  for (const auto& [dim, group] : std::vector<std::pair<int64_t, int64_t>>{{48, 16}, {45, 45},
                                                                           {1300, 650}}) {
    for (const bool norm_first : {false, true}) {
      run_norm<float>(at::kFloat, dim, group, true, true, norm_first, 1e-5);
      run_norm<float>(at::kFloat, dim, group, false, true, norm_first, 1e-5);
      run_norm<__nv_bfloat16>(at::kBFloat16, dim, group, true, true, norm_first, 1e-2);
      run_norm<__half>(at::kHalf, dim, group, true, true, norm_first, 2e-3);
    }
    run_norm<float>(at::kFloat, dim, group, true, false, false, 1e-5);  // the gate alone
    run_norm<__nv_bfloat16>(at::kBFloat16, dim, group, true, false, false, 1e-2);
  }
}

}  // namespace
}  // namespace kvserve
