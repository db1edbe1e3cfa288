// paged_attention's CUDA kernel bodies run by the CUDA emulator (cuda_emulator.h) through the
// launcher's own host plan (paged_attention_cuda_launch.h), against the CPU op: the tensor-core
// kernel in its decode (16-row) and prefill (128- and 64-row) tiles, the row kernel and the
// general one, over awkward shapes, GQA groups, block sizes, sliding windows, soft-caps and
// context splits. This tests the kernels' indexing, masking, pipelining and merging without a
// GPU; what the emulator cannot show (speed, the hardware's own fragment layouts) the `cuda`
// tests do on one.
#include "cuda_emulator.h"

#include <ATen/ops/allclose.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/rand.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/attention/paged_attention.h"
#include "kernels/attention/paged_attention_cuda_launch.h"

namespace kvserve {
namespace {

using ops::paged_attention_launch::Kernel;

struct Case {
  std::string name;
  int heads, kv_heads, head_dim, block_size;
  std::vector<std::pair<int, int>> runs;  // (query tokens, context length) per sequence
  int sliding_window = 0;
  double softcap = 0.0;
  int splits = 0;  // the context splits the plan must choose (0: any)
  int latent_value_dim = 0;  // > 0: MLA's latent, one cache for both, values its first entries
  bool nan_keys = false;     // every key NaN (a model gone bad): NaN rows, as on the CPU
  int sms = 132;             // the GPU's multiprocessors (fewer: a small prefill takes wide tiles)
  bool sinks = false;        // gpt-oss's sink logit per head (one far above the scores)
};

struct EmulatedLaunch {
  void operator()(void (*kernel)(cuda::PagedAttentionParams), dim3 grid, int threads,
                  size_t shared_bytes, const cuda::PagedAttentionParams& p) const {
    emu::launch(kernel, grid, dim3(threads), shared_bytes, p);
  }
  int resident_blocks(void (*)(cuda::PagedAttentionParams), int, size_t) const { return 2; }
  bool tensor_cores() const { return true; }
};

at::Tensor int_tensor(const std::vector<int32_t>& values) {
  at::Tensor t = at::empty({static_cast<int64_t>(values.size())}, at::kInt);
  std::copy(values.begin(), values.end(), t.data_ptr<int32_t>());
  return t;
}

/// Runs case c with queries of T (`dtype`) over caches of format F (`cache_dtype`: the query's,
/// int8 or float8_e4m3fn with random row scales) and compares with the CPU op.
template <typename T, cuda::KVFormat F = cuda::KVFormat::kPlain>
void run_case(const Case& c, at::ScalarType dtype, Kernel kernel, double tolerance,
              at::ScalarType cache_dtype = at::kFloat) {
  SCOPED_TRACE(c.name + " (" + std::string(c10::toString(dtype)) + ", cache " +
               (F == cuda::KVFormat::kPlain ? "plain" : c10::toString(cache_dtype)) + ")");
  std::mt19937 rng(1234);
  const int num_seqs = static_cast<int>(c.runs.size());
  std::vector<int32_t> starts{0}, lens;
  int max_blocks = 1, total_blocks = 0;
  for (const auto& [tokens, context] : c.runs) {
    starts.push_back(starts.back() + tokens);
    lens.push_back(context);
    const int blocks = (context + c.block_size - 1) / c.block_size;
    max_blocks = std::max(max_blocks, blocks + 1);  // a spare column the contexts do not reach
    total_blocks += blocks;
  }
  const int num_blocks = total_blocks + 3;
  std::vector<int32_t> ids(num_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<int32_t> table(static_cast<size_t>(num_seqs) * max_blocks, 0);
  int next = 0;
  for (int b = 0; b < num_seqs; ++b) {
    for (int i = 0; i < (lens[b] + c.block_size - 1) / c.block_size; ++i) {
      table[static_cast<size_t>(b) * max_blocks + i] = ids[next++];
    }
  }
  const int num_tokens = starts.back();
  const int d = c.head_dim;
  at::manual_seed(7);
  at::Tensor key = at::randn({num_blocks, c.block_size, c.kv_heads, d});
  if (c.nan_keys) key.fill_(NAN);
  at::Tensor value =
      c.latent_value_dim > 0 ? key : at::randn({num_blocks, c.block_size, c.kv_heads, d});
  std::optional<at::Tensor> key_scale, value_scale;
  if constexpr (F == cuda::KVFormat::kPlain) {
    key = key.to(dtype);
    value = c.latent_value_dim > 0 ? key : value.to(dtype);
  } else {
    // Entries of the cache's type (int8 in [-127, 127], fp8 of N(0, 4)) and positive row
    // scales around 1 / spread, so that keys and values are about N(0, 1).
    const double spread = F == cuda::KVFormat::kInt8 ? 60.0 : 2.0;
    key = key.mul(spread).clamp(-127, 127).to(cache_dtype);
    value = c.latent_value_dim > 0 ? key : value.mul(spread).clamp(-127, 127).to(cache_dtype);
    key_scale = at::rand({num_blocks, c.block_size, c.kv_heads}).add(0.5).div(spread);
    value_scale = c.latent_value_dim > 0
                      ? *key_scale
                      : at::rand({num_blocks, c.block_size, c.kv_heads}).add(0.5).div(spread);
  }
  // The queries are a view of a fused projection's output, as the engine passes them.
  const at::Tensor fused = at::randn({num_tokens, c.heads + 2 * c.kv_heads, d}).to(dtype);
  const at::Tensor query = fused.narrow(1, 0, c.heads);
  const at::Tensor qsl = int_tensor(starts), seq_lens = int_tensor(lens);
  const at::Tensor tables = int_tensor(table).view({num_seqs, max_blocks});
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));

  const int dv = c.latent_value_dim > 0 ? c.latent_value_dim : d;
  std::optional<at::Tensor> sinks;
  if (c.sinks) {
    sinks = at::randn({c.heads}).mul_(2.0);
    sinks->data_ptr<float>()[0] = 30.0f;  // the first head's output all but vanishes
  }
  at::Tensor expected = at::empty({num_tokens, c.heads, dv}, dtype);
  ops::paged_attention(expected, query, key, value, qsl, seq_lens, tables, scale,
                       c.sliding_window, c.softcap, key_scale, value_scale, sinks);
  at::Tensor actual = at::zeros({num_tokens, c.heads, dv}, dtype);
  cuda::PagedAttentionParams p = ops::paged_attention_launch::make_params(
      actual, query, key, value, qsl, seq_lens, tables, scale, c.sliding_window, c.softcap,
      key_scale, value_scale, sinks);
  // Twice: the lowest warp running ahead with copies landing at once, then the highest one
  // with copies landing as late as allowed; a race between warps or with a copy gives two
  // different results.
  EmulatedLaunch launch;
  emu::set_copy_timing(emu::CopyTiming::kEarly);
  emu::set_schedule(emu::Schedule::kWarpsAhead);
  ops::paged_attention_launch::launch_kernel<T, F>(p, num_tokens, c.sms, query, kernel, launch);
  const at::Tensor first_run = actual.clone();
  actual.zero_();
  emu::set_copy_timing(emu::CopyTiming::kLate);
  emu::set_schedule(emu::Schedule::kWarpsAheadReversed);
  ops::paged_attention_launch::launch_kernel<T, F>(p, num_tokens, c.sms, query, kernel, launch);
  emu::set_schedule(emu::Schedule::kInterleaved);
  EXPECT_TRUE(at::allclose(first_run, actual, 0.0, 0.0, /*equal_nan=*/true))
      << "the rows depend on the order of warps and copies";
  if (c.splits > 0) EXPECT_EQ(p.num_splits, c.splits);
  const at::Tensor e = expected.to(at::kFloat), a = actual.to(at::kFloat);
  const float* ep = e.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  double worst = 0.0;
  int64_t worst_index = 0;
  for (int64_t i = 0; i < e.numel(); ++i) {
    // NaN where the CPU has NaN matches; NaN elsewhere counts as worst.
    const double error = std::isnan(ep[i]) && std::isnan(ap[i])
                             ? 0.0
                             : std::abs(ep[i] - ap[i]) / (1.0 + std::abs(ep[i]));
    if (!(error <= worst)) {  // NaN counts as worst
      worst = std::isnan(error) ? INFINITY : error;
      worst_index = i;
    }
  }
  EXPECT_LE(worst, tolerance) << "token " << worst_index / (c.heads * dv) << " head "
                              << worst_index / dv % c.heads << " entry " << worst_index % dv
                              << ": expected " << ep[worst_index] << ", got " << ap[worst_index]
                              << " (" << p.num_splits << " splits)";
}

std::vector<Case> decode_cases() {
  return {
      {"decode, GQA 4, head 128, blocks of 16", 8, 2, 128, 16, {{1, 1}, {1, 37}, {1, 300}}},
      {"decode, 3 splits", 4, 1, 128, 16, {{1, 700}, {1, 65}}, 0, 0.0, 3},
      {"decode, MHA, head 64, blocks of 5", 3, 3, 64, 5, {{1, 70}, {1, 9}}},
      {"decode, group 3, window 19, soft-cap 5", 6, 2, 128, 16, {{1, 90}, {1, 18}}, 19, 5.0},
      {"decode, group 20 (two head blocks), blocks of 1", 20, 1, 64, 1, {{1, 33}, {1, 4}}},
      {"speculative verification, 3 tokens a sequence", 8, 2, 64, 16, {{3, 40}, {3, 3}}},
      {"decode, head 256, group 2, window 19, soft-cap 50", 4, 2, 256, 16, {{1, 80}, {1, 7}},
       19, 50.0},
      {"decode, window 150 over 3 splits (the first one empty)", 8, 2, 128, 16, {{1, 700}},
       150, 0.0, 3},
  };
}

std::vector<Case> prefill_cases() {
  return {
      {"prefill and chunks, GQA 4", 8, 2, 128, 16, {{5, 5}, {17, 40}, {1, 9}, {70, 70}}},
      {"a sequence without queries between two", 4, 2, 64, 16, {{20, 20}, {0, 9}, {7, 30}}},
      {"prefill, MHA, head 64, blocks of 3, window 11", 2, 2, 64, 3, {{40, 40}, {23, 50}}, 11},
      {"prefill, group 3, soft-cap 20, 2 splits", 3, 1, 128, 16, {{30, 300}}, 0, 20.0, 2},
      {"prefill, group 32 over one KV head", 32, 1, 64, 16, {{6, 20}, {2, 2}}},
      {"prefill, head 256, MHA, 2 splits", 2, 2, 256, 8, {{40, 40}, {9, 300}}, 0, 0.0, 2},
      // Whole stages below the diagonal, unmasked, then the diagonal's; a window over them. On
      // a GPU of few multiprocessors, so that 128-row tiles fill it.
      {"long chunk, GQA 4, head 128", 8, 2, 128, 16, {{160, 290}, {33, 33}}, 0, 0.0, 0, 0,
       false, 4},
      {"long chunk, GQA 2, head 64, window 70, blocks of 7", 4, 2, 64, 7, {{150, 230}}, 70, 0.0,
       0, 0, false, 2},
  };
}

TEST(PagedAttentionEmulated, SplitCountFillsWaves) {
  using ops::paged_attention_launch::split_count;
  EXPECT_EQ(split_count(400, 396, 128), 1);   // a wave's worth already
  EXPECT_EQ(split_count(317, 396, 128), 1);   // 80% of one
  EXPECT_EQ(split_count(8, 396, 2), 2);       // as many as the context allows
  EXPECT_EQ(split_count(8, 396, 128), 43);    // 344 blocks: 87% of a wave
  EXPECT_EQ(split_count(64, 396, 128), 6);    // 384 blocks: 97% of a wave
  EXPECT_EQ(split_count(1, 1, 1), 1);
}

// Sinks join the final merge only: over one split and several, decode and prefill, each kernel.
Case with_sinks(Case c) {
  c.name += ", sinks";
  c.sinks = true;
  return c;
}

TEST(PagedAttentionEmulated, EveryKernelAddsAttentionSinks) {
  run_case<__nv_bfloat16>(with_sinks(decode_cases()[1]), at::kBFloat16, Kernel::kMma, 2e-2);
  run_case<__nv_bfloat16>(with_sinks(prefill_cases()[3]), at::kBFloat16, Kernel::kMma, 2e-2);
  run_case<float>(with_sinks(decode_cases()[3]), at::kFloat, Kernel::kRows, 1e-5);
  run_case<float>(with_sinks(decode_cases()[1]), at::kFloat, Kernel::kRows, 1e-5);
  run_case<__half>(with_sinks(prefill_cases()[0]), at::kHalf, Kernel::kGeneral, 4e-3);
}

TEST(PagedAttentionEmulated, TensorCoreKernelDecodesInBf16AndFp16) {
  for (const Case& c : decode_cases()) {
    run_case<__nv_bfloat16>(c, at::kBFloat16, Kernel::kMma, 2e-2);
    run_case<__half>(c, at::kHalf, Kernel::kMma, 4e-3);
  }
}

TEST(PagedAttentionEmulated, TensorCoreKernelPrefillsInBf16AndFp16) {
  for (const Case& c : prefill_cases()) {
    run_case<__nv_bfloat16>(c, at::kBFloat16, Kernel::kMma, 2e-2);
    run_case<__half>(c, at::kHalf, Kernel::kMma, 4e-3);
  }
}

TEST(PagedAttentionEmulated, TensorCoreKernelPrefillsInSmallTiles) {
  for (const Case& c : prefill_cases()) {
    run_case<__nv_bfloat16>(c, at::kBFloat16, Kernel::kMma64, 2e-2);
  }
}

TEST(PagedAttentionEmulated, TensorCoreKernelReadsInt8AndFp8Caches) {
  const std::vector<Case> cases = {decode_cases()[0], decode_cases()[1], decode_cases()[2],
                                   prefill_cases()[0], prefill_cases()[1], prefill_cases()[6]};
  for (const Case& c : cases) {
    run_case<__nv_bfloat16, cuda::KVFormat::kInt8>(c, at::kBFloat16, Kernel::kMma, 2e-2, at::kChar);
    run_case<__half, cuda::KVFormat::kFp8E4M3>(c, at::kHalf, Kernel::kMma, 4e-3,
                                               at::kFloat8_e4m3fn);
  }
}

std::vector<Case> latent_cases() {
  Case decode{"MLA latent decode, 16 heads, 2 splits", 16, 1, 576, 16, {{1, 300}, {1, 5}}, 0,
              0.0, 2, 512};
  Case wide{"MLA latent, 40 heads (three head blocks), chunk of 3", 40, 1, 576, 8,
            {{3, 50}, {1, 1}}, 0, 0.0, 0, 512};
  return {decode, wide};
}

TEST(PagedAttentionEmulated, TensorCoreKernelReadsMlaLatents) {
  for (const Case& c : latent_cases()) {
    run_case<__nv_bfloat16>(c, at::kBFloat16, Kernel::kMma, 2e-2);
    run_case<__half, cuda::KVFormat::kFp8E4M3>(c, at::kHalf, Kernel::kMma, 4e-3,
                                               at::kFloat8_e4m3fn);
  }
}

TEST(PagedAttentionEmulated, NanKeysGiveNanRowsInEveryKernel) {
  // A prefill (128-row tiles, or 64 with mma64), and decode over split contexts (the merge).
  const std::vector<Case> cases = {
      {"prefill, GQA 4, NaN keys", 8, 2, 64, 16, {{24, 90}}, 0, 0.0, 0, 0, true, 1},
      {"decode, 3 splits, NaN keys", 4, 1, 64, 16, {{1, 700}, {1, 65}}, 0, 0.0, 3, 0, true}};
  for (const Case& c : cases) {
    run_case<__nv_bfloat16>(c, at::kBFloat16, Kernel::kMma, 2e-2);
    run_case<__nv_bfloat16>(c, at::kBFloat16, Kernel::kMma64, 2e-2);
    run_case<float>(c, at::kFloat, Kernel::kRows, 1e-5);
    run_case<__nv_bfloat16>(c, at::kBFloat16, Kernel::kGeneral, 1e-2);
  }
}

TEST(PagedAttentionEmulated, RowKernelAndGeneralKernelMatchTheCpu) {
  const std::vector<Case> cases = {decode_cases()[0], decode_cases()[3], prefill_cases()[1]};
  for (const Case& c : cases) {
    run_case<float>(c, at::kFloat, Kernel::kRows, 1e-5);
    run_case<__nv_bfloat16>(c, at::kBFloat16, Kernel::kGeneral, 1e-2);
  }
}

}  // namespace
}  // namespace kvserve
