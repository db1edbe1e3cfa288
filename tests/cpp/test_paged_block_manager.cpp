#include "kvserve/paged_block_manager.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <functional>
#include <map>
#include <numeric>
#include <ostream>
#include <random>
#include <stdexcept>
#include <tuple>

namespace kvserve {

void PrintTo(const BlockCopy& copy, std::ostream* os) { *os << copy.src << "->" << copy.dst; }

namespace {

using Ids = std::vector<int32_t>;
using Tokens = std::vector<int32_t>;

Tokens iota_tokens(int32_t first, int64_t count) {
  Tokens tokens(count);
  std::iota(tokens.begin(), tokens.end(), first);
  return tokens;
}

Tokens concat(Tokens a, const Tokens& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

Ids ref_counts(const PagedBlockManager& m) {
  Ids counts;
  for (int32_t b = 0; b < m.num_blocks(); ++b) counts.push_back(m.ref_count(b));
  return counts;
}

TEST(PagedBlockManager, AllocatesFromTheHeadOfTheFreeQueueWithoutCache) {
  PagedBlockManager m({.num_blocks = 8, .block_size = 4});
  EXPECT_EQ(m.num_usable_blocks(), 7);
  EXPECT_EQ(m.free_block_ids(), (Ids{1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(m.allocate(1, iota_tokens(0, 10)), 0);
  EXPECT_EQ(m.allocate(2, iota_tokens(100, 4)), 0);
  EXPECT_EQ(m.block_table(1), (Ids{1, 2, 3}));
  EXPECT_EQ(m.block_table(2), (Ids{4}));
  EXPECT_EQ(ref_counts(m), (Ids{0, 1, 1, 1, 1, 0, 0, 0}));
  EXPECT_EQ(m.free_block_ids(), (Ids{5, 6, 7}));
  EXPECT_DOUBLE_EQ(m.usage(), 4.0 / 7.0);
  EXPECT_EQ(m.num_tokens(1), 10);
  EXPECT_EQ(m.num_computed_tokens(1), 0);
  EXPECT_EQ(m.num_cached_blocks(), 0);
  EXPECT_EQ(m.prefix_cache_queries(), 14);
  EXPECT_EQ(m.prefix_cache_hits(), 0);
  m.check_invariants();
}

TEST(PagedBlockManager, IdenticalPromptHitsOnlyOnceItsBlocksAreComputed) {
  PagedBlockManager m({.num_blocks = 12, .block_size = 4});
  const Tokens prompt = iota_tokens(0, 10);  // two full blocks and two tokens
  EXPECT_EQ(m.allocate(1, prompt), 0);
  EXPECT_EQ(m.allocate(2, prompt), 0) << "nothing is computed yet";
  EXPECT_EQ(m.block_table(2), (Ids{4, 5, 6}));
  m.mark_computed(1, 5);  // a prefill chunk: only block 1 is full and written
  EXPECT_EQ(m.num_cached_blocks(), 1);
  EXPECT_EQ(m.allocate(3, prompt), 4);
  EXPECT_EQ(m.block_table(3), (Ids{1, 7, 8}));
  EXPECT_EQ(m.num_computed_tokens(3), 4);
  m.mark_computed(1, 10);
  m.mark_computed(2, 10);  // same content as blocks 1 and 2: left uncached
  EXPECT_EQ(m.num_cached_blocks(), 2);
  EXPECT_EQ(m.allocate(4, prompt), 8);
  EXPECT_EQ(m.block_table(4), (Ids{1, 2, 9}));
  EXPECT_EQ(ref_counts(m), (Ids{0, 3, 2, 1, 1, 1, 1, 1, 1, 1, 0, 0}));
  EXPECT_EQ(m.prefix_cache_queries(), 40);
  EXPECT_EQ(m.prefix_cache_hits(), 12);
  m.check_invariants();
}

TEST(PagedBlockManager, BlocksAfterADuplicateChainToTheCachedCopy) {
  PagedBlockManager m({.num_blocks = 12, .block_size = 4});
  const Tokens prompt = iota_tokens(0, 10);
  m.allocate(1, prompt);
  m.allocate(2, prompt);
  m.mark_computed(1, 4);   // block 1 cached
  m.mark_computed(2, 10);  // block 4 duplicates block 1; block 5 is cached as its successor
  EXPECT_EQ(m.num_cached_blocks(), 2);
  EXPECT_EQ(m.allocate(3, prompt), 8);
  EXPECT_EQ(m.block_table(3), (Ids{1, 5, 7}));
  m.check_invariants();
}

struct HitCase {
  const char* name;
  Tokens prompt;
  int64_t hit;
  Ids table;
};

TEST(PagedBlockManager, HitsFullBlocksOfTheLongestPrefixButNeverTheLastToken) {
  const Tokens cached = iota_tokens(0, 12);  // blocks 1, 2, 3 once computed
  const std::vector<HitCase> cases = {
      {"same prompt: the last block is recomputed", cached, 8, {1, 2, 4}},
      {"one more token", concat(cached, {50}), 12, {1, 2, 3, 4}},
      {"partial last block", iota_tokens(0, 11), 8, {1, 2, 4}},
      {"two blocks exactly", iota_tokens(0, 8), 4, {1, 4}},
      {"shorter than a block", iota_tokens(0, 3), 0, {4}},
      {"differs in the second block", concat(iota_tokens(0, 5), iota_tokens(60, 7)), 4, {1, 4, 5}},
      {"differs in the first token", concat({99}, iota_tokens(1, 11)), 0, {4, 5, 6}},
  };
  for (const HitCase& c : cases) {
    SCOPED_TRACE(c.name);
    PagedBlockManager m({.num_blocks = 10, .block_size = 4});
    m.allocate(1, cached);
    m.mark_computed(1, 12);
    EXPECT_EQ(m.allocate(2, c.prompt), c.hit);
    EXPECT_EQ(m.block_table(2), c.table);
    EXPECT_EQ(m.num_computed_tokens(2), c.hit);
    EXPECT_EQ(m.prefix_cache_hits(), c.hit);
    m.check_invariants();
  }
}

TEST(PagedBlockManager, ForkSharesBlocksAndAppendCopiesASharedPartialBlock) {
  PagedBlockManager m({.num_blocks = 10, .block_size = 4});
  m.allocate(1, iota_tokens(0, 6));
  m.mark_computed(1, 6);
  m.fork(1, 2);
  EXPECT_EQ(m.block_table(2), (Ids{1, 2}));
  EXPECT_EQ(m.num_computed_tokens(2), 6);
  EXPECT_EQ(ref_counts(m), (Ids{0, 2, 2, 0, 0, 0, 0, 0, 0, 0}));
  EXPECT_TRUE(m.can_append_slots(2, 1));
  EXPECT_EQ(m.append_slots(2, {99}), (std::vector<BlockCopy>{{2, 3}}));
  EXPECT_EQ(m.block_table(2), (Ids{1, 3}));
  EXPECT_EQ(ref_counts(m), (Ids{0, 2, 1, 1, 0, 0, 0, 0, 0, 0}));
  // Block 2 is now the parent's alone: written in place, no copy.
  EXPECT_EQ(m.append_slots(1, {98, 97, 96}), std::vector<BlockCopy>{});
  EXPECT_EQ(m.block_table(1), (Ids{1, 2, 4}));
  EXPECT_EQ(m.num_tokens(1), 9);
  EXPECT_EQ(m.num_tokens(2), 7);
  m.check_invariants();
}

TEST(PagedBlockManager, SharedFullLastBlockIsNeverWrittenSoNeedsNoCopy) {
  PagedBlockManager m({.num_blocks = 10, .block_size = 4});
  m.allocate(1, iota_tokens(0, 8));
  m.mark_computed(1, 8);
  m.fork(1, 2);
  EXPECT_EQ(m.append_slots(2, {99, 98}), std::vector<BlockCopy>{});
  EXPECT_EQ(m.block_table(2), (Ids{1, 2, 3}));
  EXPECT_EQ(ref_counts(m), (Ids{0, 2, 2, 1, 0, 0, 0, 0, 0, 0}));
  m.check_invariants();
}

TEST(PagedBlockManager, FreeReturnsUncachedBlocksToTheHeadAndCachedOnesToTheTail) {
  PagedBlockManager m({.num_blocks = 10, .block_size = 4});
  m.allocate(1, iota_tokens(0, 12));
  m.mark_computed(1, 12);  // blocks 1, 2, 3 cached
  m.allocate(2, iota_tokens(100, 9));
  EXPECT_EQ(m.block_table(2), (Ids{4, 5, 6}));
  m.free(2);  // uncached, freed last to first onto the head: reused in their old order
  EXPECT_EQ(m.free_block_ids(), (Ids{4, 5, 6, 7, 8, 9}));
  m.free(1);  // cached, freed last to first onto the tail: the last block is evicted first
  EXPECT_EQ(m.free_block_ids(), (Ids{4, 5, 6, 7, 8, 9, 3, 2, 1}));
  EXPECT_EQ(m.num_cached_blocks(), 3);
  EXPECT_EQ(m.num_sequences(), 0);
  EXPECT_FALSE(m.has_sequence(1));
  m.check_invariants();
}

TEST(PagedBlockManager, EvictsLeastRecentlyUsedCachedBlocksWhenThePoolRunsOut) {
  PagedBlockManager m({.num_blocks = 7, .block_size = 4});
  const Tokens a = iota_tokens(0, 8), b = iota_tokens(100, 8);
  m.allocate(1, a);
  m.mark_computed(1, 8);  // blocks 1, 2
  m.allocate(2, b);
  m.mark_computed(2, 8);  // blocks 3, 4
  m.free(1);
  m.free(2);
  EXPECT_EQ(m.free_block_ids(), (Ids{5, 6, 2, 1, 4, 3}));
  EXPECT_EQ(m.allocate(3, iota_tokens(200, 12)), 0);  // takes 5, 6 then evicts 2
  EXPECT_EQ(m.block_table(3), (Ids{5, 6, 2}));
  EXPECT_EQ(m.num_evictions(), 1);
  EXPECT_EQ(m.num_cached_blocks(), 3);
  // a's first block is revived from the middle of the queue; its second was evicted.
  EXPECT_EQ(m.allocate(4, concat(a, {7})), 4);
  EXPECT_EQ(m.block_table(4), (Ids{1, 4, 3}));
  EXPECT_EQ(m.num_evictions(), 3);
  EXPECT_EQ(m.num_cached_blocks(), 1);
  EXPECT_EQ(m.num_free_blocks(), 0);
  m.free(4);  // block 1 goes back to the tail: most recently used
  EXPECT_EQ(m.free_block_ids(), (Ids{4, 3, 1}));
  m.check_invariants();
}

TEST(PagedBlockManager, ExtraKeySeparatesIdenticalPrefixes) {
  PagedBlockManager m({.num_blocks = 12, .block_size = 4});
  const Tokens prompt = iota_tokens(0, 9);
  m.allocate(1, prompt, /*extra_key=*/7);
  m.mark_computed(1, 9);
  EXPECT_EQ(m.allocate(2, prompt), 0);
  EXPECT_EQ(m.allocate(3, prompt, 8), 0);
  EXPECT_EQ(m.allocate(4, prompt, 7), 8);
  EXPECT_EQ(m.block_table(4), (Ids{1, 2, 10}));
  m.check_invariants();
}

TEST(PagedBlockManager, HashCollisionsNeverServeAFalseHit) {
  // Every block hashes alike: only the stored content and parent can tell blocks apart.
  PagedBlockManager m(
      {.num_blocks = 14,
       .block_size = 4,
       .watermark = 0.0,
       .hash_fn = [](uint64_t, const int32_t*, int64_t, uint64_t) { return uint64_t{42}; }});
  const Tokens repeated(9, 7);  // two identical full blocks: same tokens, different parents
  m.allocate(1, repeated);
  m.mark_computed(1, 9);
  EXPECT_EQ(m.num_cached_blocks(), 1) << "block 2 collides with block 1 and stays uncached";
  EXPECT_EQ(m.allocate(2, repeated), 4) << "block 1 must not match position 1";
  EXPECT_EQ(m.block_table(2), (Ids{1, 4, 5}));
  EXPECT_EQ(m.allocate(3, concat(Tokens(4, 8), Tokens(5, 7))), 0) << "other tokens, same hash";
  EXPECT_EQ(m.allocate(4, repeated, 3), 0) << "other extra key, same hash";
  m.check_invariants();
}

TEST(PagedBlockManager, AParentBlockReusedForOtherTokensCannotLeadToItsOldChild) {
  // The hash ignores the parent: only the parent's id and generation tell the chains apart.
  PagedBlockManager m({.num_blocks = 9,
                       .block_size = 2,
                       .watermark = 0.0,
                       .hash_fn = [](uint64_t, const int32_t* tokens, int64_t n, uint64_t) {
                         return PagedBlockManager::default_block_hash(0, tokens, n, 0);
                       }});
  const Tokens a = {10, 11, 20, 21, 30};
  m.allocate(1, a);             // blocks 1, 2, 3
  m.allocate(2, a);             // blocks 4, 5, 6
  m.mark_computed(2, 2);        // block 4 caches [10, 11]
  m.mark_computed(1, 5);        // block 1 duplicates block 4; block 2 caches [20, 21] after 4
  m.free(2);                    // block 4 free and cached; its child 2 is held by sequence 1
  m.allocate(3, Tokens(8, 0));  // filler: 5, 6, 7, 8
  EXPECT_EQ(m.free_block_ids(), (Ids{4}));
  m.allocate(4, {12, 13});      // evicts block 4 and caches it again with other tokens
  m.mark_computed(4, 2);
  EXPECT_EQ(m.block_table(4), (Ids{4}));
  m.free(3);
  EXPECT_EQ(m.allocate(5, {12, 13, 20, 21, 99}), 2) << "block 2 was computed after [10, 11]";
  m.check_invariants();
}

TEST(PagedBlockManager, CanAllocateKeepsTheWatermarkFreeAndCountsFreeHitsAsTaken) {
  PagedBlockManager m(
      {.num_blocks = 11, .block_size = 4, .watermark = 0.2});  // 10 usable, 2 kept free
  const Tokens prefix = iota_tokens(0, 16);
  m.allocate(1, concat(prefix, {1}));
  m.mark_computed(1, 17);
  m.free(1);  // 4 cached blocks sit in the free queue
  struct Case {
    int64_t num_tokens;
    bool fits;
  };
  // Hits: 4 free blocks taken back out of the queue; new blocks on top of them.
  for (const Case& c : std::vector<Case>{{28, true}, {29, true}, {33, false}, {32, true}}) {
    SCOPED_TRACE(c.num_tokens);
    EXPECT_EQ(m.can_allocate(concat(prefix, Tokens(c.num_tokens - 16, 5))), c.fits);
  }
  EXPECT_TRUE(m.can_allocate(iota_tokens(100, 32)));
  EXPECT_FALSE(m.can_allocate(iota_tokens(100, 33)));
  m.allocate(2, concat(prefix, {2}));  // now the hits are held: they take no free block
  EXPECT_TRUE(m.can_allocate(concat(prefix, Tokens(12, 5))));
  EXPECT_FALSE(m.can_allocate(concat(prefix, Tokens(13, 5))));
  EXPECT_TRUE(m.can_append_slots(2, 23));
  EXPECT_FALSE(m.can_append_slots(2, 24)) << "appends ignore the watermark, not the pool";
}

TEST(PagedBlockManager, CanAppendSlotsCountsTheCopyOnWriteBlock) {
  PagedBlockManager m({.num_blocks = 4, .block_size = 4, .watermark = 0.0});
  m.allocate(1, iota_tokens(0, 6));
  m.fork(1, 2);
  EXPECT_TRUE(m.can_append_slots(2, 2)) << "one copy of the shared partial block";
  EXPECT_FALSE(m.can_append_slots(2, 3)) << "a copy plus one new block";
  EXPECT_TRUE(m.can_append_slots(2, 0));
}

TEST(PagedBlockManager, BlockSizeOneCachesEveryTokenAndNeverCopies) {
  PagedBlockManager m({.num_blocks = 8, .block_size = 1});
  m.allocate(1, {5, 6, 7});
  m.mark_computed(1, 3);
  EXPECT_EQ(m.num_cached_blocks(), 3);
  EXPECT_EQ(m.allocate(2, {5, 6, 7}), 2);
  EXPECT_EQ(m.block_table(2), (Ids{1, 2, 4}));
  m.fork(2, 3);
  EXPECT_EQ(m.append_slots(3, {8}), std::vector<BlockCopy>{});
  EXPECT_EQ(m.block_table(3), (Ids{1, 2, 4, 5}));
  EXPECT_EQ(ref_counts(m), (Ids{0, 3, 3, 1, 2, 1, 0, 0}));
  m.check_invariants();
}

TEST(PagedBlockManager, PrefixCachingOffNeverHitsNorCounts) {
  PagedBlockManager m({.num_blocks = 10, .block_size = 4, .enable_prefix_caching = false});
  m.allocate(1, iota_tokens(0, 9));
  m.mark_computed(1, 9);
  EXPECT_EQ(m.allocate(2, iota_tokens(0, 9)), 0);
  EXPECT_EQ(m.num_cached_blocks(), 0);
  EXPECT_EQ(m.prefix_cache_queries(), 0);
  m.free(1);
  EXPECT_EQ(m.free_block_ids(), (Ids{1, 2, 3, 7, 8, 9}));
  m.check_invariants();
}

TEST(PagedBlockManager, ResetPrefixCacheDropsOnlyFreeCachedBlocks) {
  PagedBlockManager m({.num_blocks = 10, .block_size = 4});
  m.allocate(1, iota_tokens(0, 9));
  m.allocate(2, iota_tokens(50, 9));
  m.mark_computed(1, 9);
  m.mark_computed(2, 9);
  m.free(1);
  m.reset_prefix_cache();
  EXPECT_EQ(m.num_cached_blocks(), 2);
  EXPECT_EQ(m.allocate(3, iota_tokens(0, 9)), 0);
  EXPECT_EQ(m.allocate(4, iota_tokens(50, 9)), 8);
  m.check_invariants();
}

TEST(PagedBlockManager, RejectsBadArgumentsAndFailedCallsChangeNothing) {
  using F = std::function<void(PagedBlockManager&)>;
  const std::vector<std::pair<F, const char*>> invalid = {
      {[](auto& m) { m.allocate(1, {1}); }, "id taken"},
      {[](auto& m) { m.allocate(2, {}); }, "empty prompt"},
      {[](auto& m) { m.allocate(2, {1, -3}); }, "negative token"},
      {[](auto& m) { m.append_slots(1, {-2}); }, "negative token"},
      {[](auto& m) { m.append_slots(1, {kPendingToken, 5}); }, "pending token not last"},
      {[](auto& m) { m.set_pending_token(1, 5); }, "no pending token"},
      {[](auto& m) { m.can_allocate({}); }, "empty prompt"},
      {[](auto& m) { m.can_append_slots(1, -1); }, "negative count"},
      {[](auto& m) { m.mark_computed(1, 6); }, "past the tokens"},
      {[](auto& m) { m.mark_computed(1, 2); }, "backwards"},
      {[](auto& m) { m.fork(1, 1); }, "child id taken"},
  };
  const std::vector<std::pair<F, const char*>> unknown = {
      {[](auto& m) { m.append_slots(9, {1}); }, "append"},
      {[](auto& m) { m.mark_computed(9, 0); }, "mark"},
      {[](auto& m) { m.fork(9, 10); }, "fork"},
      {[](auto& m) { m.free(9); }, "free"},
      {[](auto& m) { m.block_table(9); }, "table"},
      {[](auto& m) { m.ref_count(4); }, "block id"},
      {[](auto& m) { m.ref_count(-1); }, "block id"},
  };
  const std::vector<std::pair<F, const char*>> full = {
      {[](auto& m) { m.allocate(2, iota_tokens(0, 9)); }, "allocate"},
      {[](auto& m) { m.append_slots(1, iota_tokens(0, 8)); }, "append"},
  };
  auto run = [](const auto& cases, auto expect_throw) {
    for (const auto& [call, name] : cases) {
      SCOPED_TRACE(name);
      PagedBlockManager m({.num_blocks = 4, .block_size = 4});
      m.allocate(1, iota_tokens(0, 5));
      m.mark_computed(1, 4);
      expect_throw(call, m);
      EXPECT_EQ(m.free_block_ids(), (Ids{3}));
      EXPECT_EQ(m.block_table(1), (Ids{1, 2}));
      EXPECT_EQ(m.num_tokens(1), 5);
      EXPECT_EQ(m.num_computed_tokens(1), 4);
      EXPECT_EQ(m.num_sequences(), 1);
      m.check_invariants();
    }
  };
  run(invalid, [](const F& f, auto& m) { EXPECT_THROW(f(m), std::invalid_argument); });
  run(unknown, [](const F& f, auto& m) { EXPECT_THROW(f(m), std::out_of_range); });
  run(full, [](const F& f, auto& m) { EXPECT_THROW(f(m), std::runtime_error); });
  EXPECT_THROW(PagedBlockManager({.num_blocks = 1}), std::invalid_argument);
  EXPECT_THROW(PagedBlockManager({.num_blocks = 4, .block_size = 0}), std::invalid_argument);
  EXPECT_THROW(PagedBlockManager({.num_blocks = 4, .block_size = 4, .watermark = 1.0}),
               std::invalid_argument);
  EXPECT_THROW(PagedBlockManager({.num_blocks = 4, .block_size = 4, .watermark = -0.1}),
               std::invalid_argument);
}

// Random operations against a simulated KV cache: every computed position that a group's next
// query can see (all of them under full attention, the last `window` under a sliding window) must
// read back the KV of exactly its own prefix, whatever hits, copies, window moves and evictions
// happened on the way.
class RandomTrace {
 public:
  RandomTrace(int64_t block_size, bool prefix_caching, uint32_t seed,
              std::vector<int64_t> windows = {0})
      : m_({.num_blocks = 24 * static_cast<int64_t>(windows.size()),
            .block_size = block_size,
            .enable_prefix_caching = prefix_caching,
            .watermark = 0.05,
            .group_windows = windows}),
        windows_(windows),
        kv_(24 * windows.size(), std::vector<uint64_t>(block_size, 0)),
        rng_(seed) {
    for (auto& prefix : prefixes_) prefix = random_tokens(12);
  }

  void run(int num_ops) {
    for (int op = 0; op < num_ops; ++op) {
      step();
      m_.check_invariants();
      check_context();
      if (::testing::Test::HasFatalFailure()) return;
    }
    for (const auto& [id, tokens] : tokens_) m_.free(id);
    m_.check_invariants();
    EXPECT_EQ(m_.num_free_blocks(), m_.num_usable_blocks());
    EXPECT_EQ(m_.num_sequences(), 0);
  }

  const PagedBlockManager& manager() const { return m_; }
  int64_t num_copies() const { return num_copies_; }

 private:
  Tokens random_tokens(int64_t n) {
    Tokens tokens(n);
    for (auto& t : tokens) t = static_cast<int32_t>(rng_() % 5);  // small vocabulary: repeats
    return tokens;
  }
  int64_t pick() {
    auto it = tokens_.begin();
    std::advance(it, rng_() % tokens_.size());
    return it->first;
  }
  // What a real forward writes at position p: a value determined by the whole prefix 0..p.
  static uint64_t kv_value(const Tokens& tokens, int64_t p) {
    return PagedBlockManager::default_block_hash(1, tokens.data(), p + 1, 0);
  }
  uint64_t& slot(int64_t id, int64_t group, int64_t p) {
    return kv_[m_.block_table(id, group)[p / m_.block_size()]][p % m_.block_size()];
  }
  bool sliding() const {
    return std::any_of(windows_.begin(), windows_.end(), [](int64_t w) { return w > 0; });
  }

  void step() {
    const uint32_t kind = rng_() % 10;
    if (tokens_.empty() || kind < 3) return allocate();
    const int64_t id = pick();
    if (kind < 7) {  // a prefill chunk, or a decode step once everything is computed
      const bool pending = m_.num_computed_tokens(id) < static_cast<int64_t>(tokens_[id].size());
      return pending ? compute(id) : append(id);
    }
    if (kind == 7) {
      m_.fork(id, next_id_);
      tokens_[next_id_++] = tokens_[id];
      return;
    }
    if (rng_() % 20 == 0) m_.reset_prefix_cache();
    m_.free(id);
    tokens_.erase(id);
  }

  void allocate() {
    Tokens prompt(prefixes_[rng_() % prefixes_.size()]);
    prompt.resize(rng_() % (prompt.size() + 1));
    prompt = concat(prompt, random_tokens(1 + rng_() % 8));
    // Sliding groups: a first chunk of random size (or the whole prompt).
    const int64_t scheduled = sliding() && rng_() % 2 ? 1 + rng_() % prompt.size() : -1;
    if (!m_.can_allocate(prompt, 0, scheduled)) return;
    const int64_t hit = m_.allocate(next_id_, prompt, 0, scheduled);
    ASSERT_EQ(hit % m_.block_size(), 0);
    ASSERT_LT(hit, static_cast<int64_t>(prompt.size()));
    tokens_[next_id_++] = prompt;
  }

  void compute(int64_t id) {
    const Tokens& tokens = tokens_[id];
    const int64_t begin = m_.num_computed_tokens(id);
    const int64_t end = begin + 1 + rng_() % (tokens.size() - begin);  // a prefill chunk
    if (!m_.can_reserve_prefill(id, end)) return;
    m_.reserve_prefill(id, end);
    for (int64_t g = 0; g < m_.num_groups(); ++g) {
      for (int64_t p = begin; p < end; ++p) slot(id, g, p) = kv_value(tokens, p);
    }
    m_.mark_computed(id, end);
  }

  void append(int64_t id) {
    const Tokens extra = random_tokens(1 + rng_() % 3);
    if (!m_.can_append_slots(id, extra.size())) return;
    for (const BlockCopy& copy : m_.append_slots(id, extra)) {
      kv_[copy.dst] = kv_[copy.src];
      ++num_copies_;
    }
    tokens_[id] = concat(tokens_[id], extra);
  }

  void check_context() {
    for (const auto& [id, tokens] : tokens_) {
      ASSERT_EQ(m_.num_tokens(id), static_cast<int64_t>(tokens.size()));
      const int64_t computed = m_.num_computed_tokens(id);
      for (int64_t g = 0; g < m_.num_groups(); ++g) {
        const int64_t w = windows_[g];
        for (int64_t p = w > 0 ? std::max<int64_t>(0, computed - w + 1) : 0; p < computed; ++p) {
          ASSERT_EQ(slot(id, g, p), kv_value(tokens, p))
              << "sequence " << id << " group " << g << " position " << p;
        }
      }
    }
  }

  PagedBlockManager m_;
  std::vector<int64_t> windows_;
  std::vector<std::vector<uint64_t>> kv_;  // [num_blocks][block_size]: what each slot holds
  std::mt19937 rng_;
  std::array<Tokens, 3> prefixes_;
  std::map<int64_t, Tokens> tokens_;
  int64_t next_id_ = 0;
  int64_t num_copies_ = 0;
};

class PagedBlockManagerRandom : public ::testing::TestWithParam<std::tuple<int64_t, bool>> {};

TEST_P(PagedBlockManagerRandom, KeepsInvariantsAndServesOnlyCorrectKV) {
  const auto [block_size, prefix_caching] = GetParam();
  for (uint32_t seed : {1u, 2u, 3u}) {
    SCOPED_TRACE(seed);
    RandomTrace trace(block_size, prefix_caching, seed);
    trace.run(3000);
    const PagedBlockManager& m = trace.manager();
    if (prefix_caching) {  // the trace must reach the interesting paths
      EXPECT_GT(m.prefix_cache_hits(), 0);
      EXPECT_GT(m.num_evictions(), 0);
    } else {
      EXPECT_EQ(m.num_cached_blocks(), 0);
    }
    if (block_size > 1) {
      EXPECT_GT(trace.num_copies(), 0);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(BlockSizes, PagedBlockManagerRandom,
                         ::testing::Combine(::testing::Values(1, 2, 4), ::testing::Bool()));

// The same with a full-attention group beside sliding-window ones (a hybrid local/global model),
// and with sliding groups only (Mistral), windows shorter and longer than a block.
class PagedBlockManagerRandomGroups
    : public ::testing::TestWithParam<std::tuple<int64_t, bool, std::vector<int64_t>>> {};

TEST_P(PagedBlockManagerRandomGroups, KeepsInvariantsAndServesOnlyCorrectKV) {
  const auto& [block_size, prefix_caching, windows] = GetParam();
  for (uint32_t seed : {1u, 2u, 3u}) {
    SCOPED_TRACE(seed);
    RandomTrace trace(block_size, prefix_caching, seed, windows);
    trace.run(3000);
    if (prefix_caching) EXPECT_GT(trace.manager().prefix_cache_hits(), 0);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Windows, PagedBlockManagerRandomGroups,
    ::testing::Combine(::testing::Values(1, 4), ::testing::Bool(),
                       ::testing::Values(std::vector<int64_t>{0, 3}, std::vector<int64_t>{5, 0, 9},
                                         std::vector<int64_t>{6})));

// A pending token (asynchronous scheduling) may end the appended tokens; the block holding it is
// never hashed before its value is set.
TEST(PagedBlockManager, APendingTokenIsHashedOnlyOnceSet) {
  PagedBlockManager m({.num_blocks = 8, .block_size = 4, .enable_prefix_caching = true});
  m.allocate(1, {5, 6, 7});
  m.mark_computed(1, 3);
  m.append_slots(1, {kPendingToken});
  EXPECT_THROW(m.mark_computed(1, 4), std::logic_error);
  m.set_pending_token(1, 8);
  m.mark_computed(1, 4);
  EXPECT_EQ(m.allocate(2, {5, 6, 7, 8, 9}), 4);
  m.free(1);
  m.free(2);
  m.check_invariants();
}

}  // namespace
}  // namespace kvserve
