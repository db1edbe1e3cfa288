// The PagedBlockManager with several groups of layers (hybrid local/global models): sliding-window
// groups give back the blocks that leave their window and reserve prefill chunk by chunk, so their
// usage stays flat however long the sequence; prefix hits need each group's own blocks.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <ostream>
#include <vector>

#include "kvserve/paged_block_manager.h"

namespace kvserve {
namespace {

using Ids = std::vector<int32_t>;
using Tokens = std::vector<int32_t>;
constexpr int64_t kFull = 0;

Tokens iota_tokens(int32_t first, int64_t count) {
  Tokens tokens(count);
  std::iota(tokens.begin(), tokens.end(), first);
  return tokens;
}

// Decodes `steps` tokens one step at a time, as the scheduler and the engine would.
void decode(PagedBlockManager& m, int64_t seq, int64_t steps, int32_t first_token = 1000) {
  for (int64_t i = 0; i < steps; ++i) {
    m.append_slots(seq, {static_cast<int32_t>(first_token + i % 7)});
    m.mark_computed(seq, m.num_tokens(seq));
  }
}

TEST(BlockTablePolicy, FullAttentionKeepsEveryBlockAWindowOnlyWhatItsQueriesSee) {
  const BlockTablePolicy full(kFull, 4), local(6, 4);
  EXPECT_FALSE(full.sliding());
  EXPECT_TRUE(local.sliding());
  EXPECT_TRUE(full.chains_parents());
  EXPECT_FALSE(local.chains_parents());
  // Tables cover all tokens and lookahead slots, or what the window's chunks reserved.
  EXPECT_EQ(full.table_size(/*full_end=*/13, /*sliding_end=*/5), 4);
  EXPECT_EQ(local.table_size(13, 5), 2);
  // A query at position p sees p - 5 .. p: from position 9 on, block 1 (positions 4..7) and later.
  for (int64_t computed : {0, 5, 9, 100}) EXPECT_EQ(full.first_visible_block(computed), 0);
  EXPECT_EQ(local.first_visible_block(5), 0);
  EXPECT_EQ(local.first_visible_block(9), 1);
  EXPECT_EQ(local.first_visible_block(14), 2);
  // Held at most: everything, or the window and the chunk's blocks plus the two partial ends.
  EXPECT_EQ(full.max_blocks_held(1000, 1), 250);
  EXPECT_EQ(local.max_blocks_held(1000, 1), 6 / 4 + 2);
  EXPECT_EQ(local.max_blocks_held(1000, 64), (6 + 64 - 1) / 4 + 2);
  EXPECT_EQ(local.max_blocks_held(5, 5), 2);  // never more than the sequence's blocks
}

TEST(PagedBlockManagerGroups, SlidingGroupGivesBackBlocksThatLeaveTheWindow) {
  // Block size 4, window 6: a query at position p sees positions p - 5 .. p.
  PagedBlockManager m(
      {.num_blocks = 32, .block_size = 4, .watermark = 0.0, .group_windows = {kFull, 6}});
  EXPECT_EQ(m.num_groups(), 2);
  EXPECT_EQ(m.allocate(1, iota_tokens(0, 5)), 0);
  EXPECT_EQ(m.block_table(1, 0), (Ids{1, 2}));
  EXPECT_EQ(m.block_table(1, 1), (Ids{3, 4}));
  m.mark_computed(1, 5);
  decode(m, 1, 4);  // tokens 5..8 computed; the next query is at position 9
  EXPECT_EQ(m.block_table(1, 0), (Ids{1, 2, 5}));
  EXPECT_EQ(m.block_table(1, 1), (Ids{3, 4, 6}));
  m.append_slots(1, {2000});  // the step computing position 9 sees positions 4..9: block 0 goes
  EXPECT_EQ(m.block_table(1, 0), (Ids{1, 2, 5}));
  EXPECT_EQ(m.block_table(1, 1), (Ids{0, 4, 6}));
  EXPECT_EQ(m.ref_count(3), 0);
  EXPECT_EQ(m.free_block_ids().back(), 3) << "cached: it waits at the LRU end for a prefix hit";
  m.mark_computed(1, 10);
  decode(m, 1, 4);  // next query at 14 sees 9..14: blocks 0 and 1 gone
  EXPECT_EQ(m.block_table(1, 1), (Ids{0, 0, 6, 8}));
  EXPECT_EQ(m.num_live_blocks(1, 0), 4);
  EXPECT_EQ(m.num_live_blocks(1, 1), 2);
  m.check_invariants();
  m.free(1);
  EXPECT_EQ(m.num_free_blocks(), m.num_usable_blocks());
  m.check_invariants();
}

TEST(PagedBlockManagerGroups, LocalUsageStaysFlatOverTenThousandDecodedTokens) {
  const int64_t block_size = 16, window = 64;
  PagedBlockManager m({.num_blocks = 800,
                       .block_size = block_size,
                       .watermark = 0.0,
                       .group_windows = {kFull, window}});
  m.allocate(7, iota_tokens(0, 10));
  m.mark_computed(7, 10);
  int64_t most = 0;
  for (int64_t step = 0; step < 10000; ++step) {
    decode(m, 7, 1, static_cast<int32_t>(step % 50));
    most = std::max(most, m.num_live_blocks(7, 1));
  }
  // The window plus the block being written, whatever the length.
  EXPECT_LE(most, window / block_size + 1);
  EXPECT_EQ(m.num_live_blocks(7, 0), (10010 + block_size - 1) / block_size);
  m.check_invariants();
}

TEST(PagedBlockManagerGroups, ChunkedPrefillReservesLocalBlocksChunkByChunk) {
  const int64_t block_size = 16, window = 64, chunk = 256;
  PagedBlockManager m({.num_blocks = 800,
                       .block_size = block_size,
                       .enable_prefix_caching = false,
                       .watermark = 0.0,
                       .group_windows = {window, kFull}});
  const Tokens prompt = iota_tokens(0, 5000);
  EXPECT_EQ(m.allocate(3, prompt, 0, chunk), 0);
  EXPECT_EQ(m.num_live_blocks(3, 0), chunk / block_size);
  EXPECT_EQ(m.num_live_blocks(3, 1), (5000 + block_size - 1) / block_size);
  int64_t most = 0;
  for (int64_t done = chunk; done < 5000; done += chunk) {
    m.mark_computed(3, done);
    ASSERT_TRUE(m.can_reserve_prefill(3, std::min<int64_t>(done + chunk, 5000)));
    m.reserve_prefill(3, std::min<int64_t>(done + chunk, 5000));
    most = std::max(most, m.num_live_blocks(3, 0));
    m.check_invariants();
  }
  EXPECT_LE(most, (window + chunk) / block_size + 1);
  EXPECT_THROW(m.reserve_prefill(3, 5001), std::invalid_argument);
  m.mark_computed(3, 5000);
  m.check_invariants();
}

TEST(PagedBlockManagerGroups, MarkComputedNeedsReservedLocalSlots) {
  PagedBlockManager m({.num_blocks = 64,
                       .block_size = 4,
                       .enable_prefix_caching = false,
                       .watermark = 0.0,
                       .group_windows = {kFull, 8}});
  m.allocate(1, iota_tokens(0, 40), 0, 8);
  m.mark_computed(1, 8);
  EXPECT_THROW(m.mark_computed(1, 12), std::invalid_argument);
  m.reserve_prefill(1, 40);
  m.mark_computed(1, 40);
  m.check_invariants();
}

TEST(PagedBlockManagerGroups, AdmissionCountsOnlyTheLocalWindowAndTheFirstChunk) {
  // 20 usable blocks of 4 tokens: a 48-token prompt takes 12 in the full group; its local group
  // needs only its first chunk of 8 tokens (2 blocks), not 12 more.
  PagedBlockManager m({.num_blocks = 21,
                       .block_size = 4,
                       .enable_prefix_caching = false,
                       .watermark = 0.0,
                       .group_windows = {kFull, 6}});
  const Tokens prompt = iota_tokens(0, 48);
  EXPECT_FALSE(m.can_allocate(prompt));  // the whole prompt in both groups: 24 blocks
  EXPECT_TRUE(m.can_allocate(prompt, 0, 8));
  m.allocate(1, prompt, 0, 8);
  EXPECT_EQ(m.num_free_blocks(), 20 - 12 - 2);
  m.check_invariants();
}

TEST(PagedBlockManagerGroups, PrefixHitNeedsTheFullChainAndOnlyTheLocalWindow) {
  // 15 usable blocks: a 40-token prompt fills 10 in the full group, and its chunked prefill
  // recycles the local group's blocks, evicting the early ones that left the window.
  PagedBlockManager m(
      {.num_blocks = 16, .block_size = 4, .watermark = 0.0, .group_windows = {kFull, 6}});
  const Tokens prompt = iota_tokens(0, 40);
  m.allocate(1, prompt, 0, 8);
  for (int64_t done = 8; done <= 40; done += 8) {
    m.mark_computed(1, done);
    if (done < 40) m.reserve_prefill(1, done + 8);
  }
  EXPECT_GT(m.num_evictions(), 0);
  m.check_invariants();
  m.free(1);
  // The whole prompt again: 9 blocks of hit (the last token is always computed); the local group
  // needs blocks 7 and 8 only (the window of position 36), which are cached.
  EXPECT_EQ(m.allocate(2, prompt), 36);
  EXPECT_EQ(m.block_table(2, 1)[6], 0) << "before the window: no block";
  EXPECT_NE(m.block_table(2, 1)[7], 0);
  m.check_invariants();
  m.free(2);
  // Its first 21 tokens: the full group still has blocks 0..4, but the local group's window of
  // position 20 (blocks 3 and 4), or of any shorter prefix, was evicted: no hit.
  EXPECT_EQ(m.allocate(3, iota_tokens(0, 21)), 0);
  m.check_invariants();
}

TEST(PagedBlockManagerGroups, GroupsNeverServeEachOthersBlocks) {
  // Two groups with the same window share every hash; each must still find its own blocks.
  PagedBlockManager m(
      {.num_blocks = 64, .block_size = 4, .watermark = 0.0, .group_windows = {8, 8}});
  const Tokens prompt = iota_tokens(0, 17);
  m.allocate(1, prompt);
  m.mark_computed(1, 17);
  m.free(1);
  EXPECT_EQ(m.allocate(2, prompt), 16);
  for (int64_t i = 2; i < 4; ++i) {
    EXPECT_NE(m.block_table(2, 0)[i], m.block_table(2, 1)[i]);
  }
  m.check_invariants();
}

TEST(PagedBlockManagerGroups, ForkCopiesThePartialBlockInEveryGroup) {
  PagedBlockManager m(
      {.num_blocks = 64, .block_size = 4, .watermark = 0.0, .group_windows = {kFull, 6}});
  m.allocate(1, iota_tokens(0, 6));
  m.mark_computed(1, 6);
  m.fork(1, 2);
  const std::vector<BlockCopy> copies = m.append_slots(2, {99});
  ASSERT_EQ(copies.size(), 2u);
  EXPECT_EQ(copies[0].src, m.block_table(1, 0)[1]);
  EXPECT_EQ(copies[1].src, m.block_table(1, 1)[1]);
  EXPECT_EQ(copies[1].dst, m.block_table(2, 1)[1]);
  m.check_invariants();
  m.free(1);
  m.free(2);
  EXPECT_EQ(m.num_free_blocks(), m.num_usable_blocks());
}

TEST(PagedBlockManagerGroups, MostBlocksASequenceHoldsAtOnce) {
  // Blocks of 4, window 6, a 100-token prompt in chunks of 16, decoded to 200 tokens.
  const PagedBlockManager hybrid(
      {.num_blocks = 64, .block_size = 4, .watermark = 0.0, .group_windows = {kFull, 6}});
  // End of prefill: 25 global + 7 local (window and chunk); end of decode: 50 + 3.
  EXPECT_EQ(hybrid.max_blocks_held(100, 200, 16), 53);
  EXPECT_EQ(hybrid.max_blocks_held(100, 100, 100), 25 + 25);
  const PagedBlockManager full({.num_blocks = 64, .block_size = 4});
  EXPECT_EQ(full.max_blocks_held(100, 200, 16), 50);
}

TEST(PagedBlockManagerGroups, RejectsBadWindows) {
  EXPECT_THROW(
      PagedBlockManager({.num_blocks = 8, .block_size = 4, .watermark = 0.0, .group_windows = {}}),
      std::invalid_argument);
  EXPECT_THROW(PagedBlockManager(
                   {.num_blocks = 8, .block_size = 4, .watermark = 0.0, .group_windows = {0, -1}}),
               std::invalid_argument);
}

}  // namespace
}  // namespace kvserve
