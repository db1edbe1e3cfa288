// BlockPool on its own: hand-out order, reference counts, eviction order of cached blocks,
// generations, the prefix-cache map and the self-check.
#include <gtest/gtest.h>

#include <stdexcept>
#include <vector>

#include "kvserve/block_pool.h"

namespace kvserve {
namespace {

CachedBlock content(uint64_t key, std::vector<int32_t> tokens = {1, 2}) {
  return {.hash = key, .key = key, .tokens = std::move(tokens)};
}

// One table entry per reference: what check_invariants compares the counts with.
std::vector<int64_t> refs_of(const BlockPool& pool) {
  std::vector<int64_t> refs(pool.num_blocks(), 0);
  for (int32_t b = 1; b < pool.num_blocks(); ++b) refs[b] = pool.ref_count(b);
  return refs;
}

TEST(BlockPool, HandsOutEveryBlockButTheNullBlockOnce) {
  BlockPool pool(5);
  EXPECT_EQ(pool.num_usable_blocks(), 4);
  EXPECT_EQ(pool.free_block_ids(), (std::vector<int32_t>{1, 2, 3, 4}));
  std::vector<int32_t> taken;
  for (int i = 0; i < 4; ++i) taken.push_back(pool.take());
  EXPECT_EQ(taken, (std::vector<int32_t>{1, 2, 3, 4}));
  EXPECT_EQ(pool.num_free_blocks(), 0);
  EXPECT_DOUBLE_EQ(pool.usage(), 1.0);
  EXPECT_THROW(pool.take(), std::logic_error);
  pool.check_invariants(refs_of(pool));
  EXPECT_THROW(BlockPool(1), std::invalid_argument);
  EXPECT_THROW(pool.ref_count(5), std::out_of_range);
  EXPECT_THROW(pool.ref_count(-1), std::out_of_range);
}

TEST(BlockPool, FreedUncachedBlocksComeFirstAndCachedOnesLeastRecentlyFreedFirst) {
  BlockPool pool(6);
  const int32_t a = pool.take(), b = pool.take(), c = pool.take(), d = pool.take();
  pool.cache(a, content(10));
  pool.cache(b, content(11));
  pool.release(a);  // cached: to the tail
  pool.release(c);  // uncached: to the head
  pool.release(b);  // cached: behind a
  EXPECT_EQ(pool.free_block_ids(), (std::vector<int32_t>{c, 5, a, b}));
  pool.check_invariants(refs_of(pool));
  // A prefix hit takes a free cached block out of the middle.
  EXPECT_EQ(pool.find(10), a);
  pool.acquire(a);
  EXPECT_EQ(pool.free_block_ids(), (std::vector<int32_t>{c, 5, b}));
  // Handing b out again evicts its content and bumps its generation.
  const BlockRef old_b = pool.ref(b);
  EXPECT_TRUE(pool.is_live(old_b));
  EXPECT_EQ(pool.take(), c);
  EXPECT_EQ(pool.take(), 5);
  EXPECT_EQ(pool.take(), b);
  EXPECT_EQ(pool.num_evictions(), 1);
  EXPECT_EQ(pool.find(11), -1);
  EXPECT_FALSE(pool.is_cached(b));
  EXPECT_FALSE(pool.is_live(old_b));
  EXPECT_TRUE(pool.is_live({0, 0}));    // the root
  EXPECT_FALSE(pool.is_live({-1, 0}));  // a broken chain
  EXPECT_EQ(pool.ref_count(d), 1);
  pool.check_invariants(refs_of(pool));
}

TEST(BlockPool, SharedBlocksReturnAtTheirLastRelease) {
  BlockPool pool(3);
  const int32_t a = pool.take();
  pool.acquire(a);
  EXPECT_EQ(pool.ref_count(a), 2);
  pool.release(a);
  EXPECT_EQ(pool.num_free_blocks(), 1);
  pool.release(a);
  EXPECT_EQ(pool.num_free_blocks(), 2);
  EXPECT_EQ(pool.free_block_ids().front(), a);
}

TEST(BlockPool, ForgettingContentMakesAFreeBlockTheNextHandedOut) {
  BlockPool pool(5);
  const int32_t a = pool.take(), b = pool.take();
  pool.cache(a, content(1));
  pool.cache(b, content(2));
  pool.release(a);
  EXPECT_EQ(pool.free_block_ids().back(), a);
  pool.uncache(a);
  EXPECT_EQ(pool.free_block_ids().front(), a);
  EXPECT_EQ(pool.num_cached_blocks(), 1);
  // reset_prefix_cache forgets free blocks' content only.
  const int32_t c = pool.take();
  EXPECT_EQ(c, a);
  pool.cache(c, content(3));
  pool.release(c);
  pool.reset_prefix_cache();
  EXPECT_EQ(pool.find(3), -1);
  EXPECT_EQ(pool.find(2), b);
  pool.check_invariants(refs_of(pool));
}

TEST(BlockPool, TheSelfCheckCatchesCountsThatDisagreeWithTheTables) {
  BlockPool pool(4);
  const int32_t a = pool.take();
  std::vector<int64_t> refs = refs_of(pool);
  pool.check_invariants(refs);
  refs[a] = 2;
  EXPECT_THROW(pool.check_invariants(refs), std::logic_error);
  refs[a] = 1;
  refs[0] = 1;  // a table holding the null block as a real block
  EXPECT_THROW(pool.check_invariants(refs), std::logic_error);
}

}  // namespace
}  // namespace kvserve
