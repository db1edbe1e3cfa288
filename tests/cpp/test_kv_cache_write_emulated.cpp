// kv_cache_write's CUDA kernel body run by the CUDA emulator (cuda_emulator.h) with the
// launcher's launch shape (a block of kv_cache_write_threads per (token, KV head) row and cache),
// against the CPU op: plain, int8 and fp8 caches, every dtype, awkward head sizes, padding and
// strided rows; a latent cache (one for keys and values) writes the keys alone.
#include "cuda_emulator.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/randn.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kernels/cache/kv_cache_write.h"
#include "kernels/cache/kv_cache_write_kernel.cuh"

namespace kvserve {
namespace {

template <typename T, cuda::KVFormat F>
void run_case(at::ScalarType dtype, at::ScalarType cache_dtype, int64_t heads, int64_t head_dim,
              bool latent) {
  SCOPED_TRACE(std::string(c10::toString(dtype)) + " -> " + c10::toString(cache_dtype) +
               ", heads " + std::to_string(heads) + ", head_dim " + std::to_string(head_dim) +
               (latent ? ", latent" : ""));
  using Entry = typename cuda::KVEntry<T, F>::type;
  at::manual_seed(5);
  const int64_t tokens = 5, blocks = 3, block_size = 4;
  const std::vector<int64_t> slots = {7, -1, 0, 11, 2};  // -1: padding
  const at::Tensor key = at::randn({tokens, heads + 2, head_dim}).to(dtype).narrow(1, 1, heads);
  const at::Tensor value = at::randn({tokens, heads, head_dim}).to(dtype);
  at::Tensor slot_mapping = at::empty({tokens}, at::kLong);
  std::copy(slots.begin(), slots.end(), slot_mapping.data_ptr<int64_t>());
  const bool quantized = F != cuda::KVFormat::kPlain;
  struct Caches {
    at::Tensor key, value;
    std::optional<at::Tensor> key_scale, value_scale;
  };
  const auto make = [&] {
    Caches c;
    c.key = at::full({blocks, block_size, heads, head_dim}, 3.0).to(cache_dtype);
    c.value = latent ? c.key : at::full({blocks, block_size, heads, head_dim}, 3.0).to(cache_dtype);
    if (quantized) {
      c.key_scale = at::full({blocks, block_size, heads}, -1.0);
      c.value_scale = latent ? c.key_scale : at::full({blocks, block_size, heads}, -1.0);
    }
    return c;
  };
  Caches expected = make(), actual = make();
  ops::kv_cache_write(key, value, expected.key, expected.value, slot_mapping,
                      expected.key_scale, expected.value_scale);
  emu::launch(cuda::kv_cache_write_kernel<T, F>, dim3(tokens, heads, latent ? 1 : 2),
              dim3(cuda::kv_cache_write_threads(head_dim)), 0,
              static_cast<const T*>(key.data_ptr()), key.stride(0),
              static_cast<const T*>(value.data_ptr()), value.stride(0),
              static_cast<Entry*>(actual.key.data_ptr()),
              static_cast<Entry*>(actual.value.data_ptr()),
              quantized ? actual.key_scale->template data_ptr<float>() : nullptr,
              quantized ? actual.value_scale->template data_ptr<float>() : nullptr,
              slot_mapping.data_ptr<int64_t>(), blocks * block_size, heads, head_dim);
  // Entries and scales bit for bit (the same rounding), untouched slots included.
  EXPECT_TRUE(actual.key.view(at::kByte).equal(expected.key.view(at::kByte)));
  EXPECT_TRUE(actual.value.view(at::kByte).equal(expected.value.view(at::kByte)));
  if (quantized) {
    EXPECT_TRUE(actual.key_scale->equal(*expected.key_scale));
    EXPECT_TRUE(actual.value_scale->equal(*expected.value_scale));
  }
}

TEST(KVCacheWriteEmulated, MatchesTheCpuOpBitForBit) {
  for (const auto& [heads, head_dim] : std::vector<std::pair<int64_t, int64_t>>{
           {2, 24}, {1, 64}, {3, 130}, {1, 576}}) {
    const bool latent = head_dim == 576;
    run_case<float, cuda::KVFormat::kPlain>(at::kFloat, at::kFloat, heads, head_dim, latent);
    run_case<__nv_bfloat16, cuda::KVFormat::kPlain>(at::kBFloat16, at::kBFloat16, heads,
                                                    head_dim, latent);
    run_case<__half, cuda::KVFormat::kInt8>(at::kHalf, at::kChar, heads, head_dim, latent);
    run_case<__nv_bfloat16, cuda::KVFormat::kFp8E4M3>(at::kBFloat16, at::kFloat8_e4m3fn, heads,
                                                      head_dim, latent);
    run_case<float, cuda::KVFormat::kInt8>(at::kFloat, at::kChar, heads, head_dim, latent);
  }
}

}  // namespace
}  // namespace kvserve
