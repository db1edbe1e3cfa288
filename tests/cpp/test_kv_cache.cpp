#include "kvserve/kv_cache.h"

#include <gtest/gtest.h>

#include <stdexcept>

namespace kvserve {
namespace {

TEST(KVCache, AllocatesTheDocumentedLayout) {
  KVCache cache(3, 17, 2, 24, at::kBFloat16, at::Device("cpu"));
  EXPECT_EQ(cache.key().sizes(), (std::vector<int64_t>{3, 17, 2, 24}));
  EXPECT_EQ(cache.value().sizes(), cache.key().sizes());
  EXPECT_EQ(cache.key().scalar_type(), at::kBFloat16);
  EXPECT_NE(cache.key().data_ptr(), cache.value().data_ptr());
  EXPECT_EQ(cache.nbytes(), 2 * 3 * 17 * 2 * 24 * 2);
  // The paged view is the same storage: row b is block b of max_seq_len tokens.
  EXPECT_EQ(cache.layer_view().key.data_ptr(), cache.key().data_ptr());
}

TEST(KVCache, TracksLengthsPerRowAndResets) {
  KVCache cache(2, 8, 1, 4, at::kFloat, at::Device("cpu"));
  cache.advance(0, 3);
  cache.advance(0, 5);
  cache.advance(1, 1);
  EXPECT_EQ(cache.seq_len(0), 8);
  EXPECT_EQ(cache.seq_len(1), 1);
  EXPECT_THROW(cache.advance(0, 1), std::out_of_range);
  EXPECT_EQ(cache.seq_len(0), 8);  // a refused advance changes nothing
  cache.reset();
  EXPECT_EQ(cache.seq_lens(), (std::vector<int64_t>{0, 0}));
}

TEST(KVCache, RejectsNonPositiveSizes) {
  EXPECT_THROW(KVCache(0, 8, 1, 4, at::kFloat, at::Device("cpu")), std::invalid_argument);
  EXPECT_THROW(KVCache(1, 8, 1, 0, at::kFloat, at::Device("cpu")), std::invalid_argument);
}

TEST(KVCache, FromModelConfigMakesIndependentLayers) {
  auto caches = KVCache::from_model_config(2, 16, 4, 2, 8, at::kFloat, at::Device("cpu"));
  ASSERT_EQ(caches.size(), 4u);
  caches[1].advance(0, 5);
  EXPECT_EQ(caches[0].seq_len(0), 0);
  EXPECT_NE(caches[0].key().data_ptr(), caches[1].key().data_ptr());
}

}  // namespace
}  // namespace kvserve
