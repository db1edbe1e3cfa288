// The Scheduler over a real PagedBlockManager: exact step-by-step traces of the token budget,
// chunked prefill, admission order, preemption and forks, and a randomized run that checks the
// invariants after every step and that every sequence completes.
#include "kvserve/scheduler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <stdexcept>

namespace kvserve {
namespace {

std::vector<int32_t> prompt(int32_t first, int64_t len) {
  std::vector<int32_t> p(len);
  for (int64_t i = 0; i < len; ++i) p[i] = first + static_cast<int32_t>(i);
  return p;
}

/// (seq id, num_computed, num_new_tokens, samples) of every scheduled sequence.
using Trace = std::vector<std::tuple<int64_t, int64_t, int64_t, bool>>;

Trace trace(const SchedulerOutput& out) {
  Trace t;
  for (const auto& s : out.scheduled) t.emplace_back(s.seq_id, s.num_computed, s.num_new_tokens, s.samples);
  return t;
}

/// Runs the step and appends a token to every sequence that sampled.
Trace step(Scheduler& scheduler, int32_t token = 7) {
  SchedulerOutput out = scheduler.schedule();
  scheduler.update_computed(out);
  for (const auto& s : out.scheduled) {
    if (s.samples) scheduler.append_token(s.seq_id, token);
  }
  scheduler.check_invariants();
  return trace(out);
}

TEST(Scheduler, ChunkedPrefillUnderTheTokenBudgetThenDecodesFirst) {
  PagedBlockManager blocks({.num_blocks = 64, .block_size = 4});
  SequenceTable sequences;
  Scheduler scheduler({/*max_num_seqs=*/8, /*max_num_batched_tokens=*/10, /*max_model_len=*/64},
                      blocks, sequences);
  scheduler.add(0, prompt(100, 6));
  scheduler.add(1, prompt(200, 13));
  // Step 1: seq 0's whole prompt (6), then 4 tokens of seq 1's prompt.
  EXPECT_EQ(step(scheduler), (Trace{{0, 0, 6, true}, {1, 0, 4, false}}));
  // Step 2: seq 0 decodes first, then seq 1 continues its prefill with the rest of the budget.
  EXPECT_EQ(step(scheduler), (Trace{{0, 6, 1, true}, {1, 4, 9, true}}));
  EXPECT_EQ(step(scheduler), (Trace{{0, 7, 1, true}, {1, 13, 1, true}}));
  EXPECT_EQ(scheduler.num_running(), 2);
  scheduler.finish(0);
  scheduler.finish(1);
  EXPECT_FALSE(scheduler.has_pending_work());
  EXPECT_EQ(blocks.num_sequences(), 0);
  scheduler.check_invariants();
}

// Asynchronous scheduling: a sequence whose sample is still on its way ends with kPendingToken;
// it is scheduled as a decode, its block enters the prefix cache only once the value is set, and
// a sequence with nothing left to compute is passed over without stopping the others' prefills.
TEST(Scheduler, PendingTokensAreScheduledAndHashedOnlyOnceSet) {
  PagedBlockManager blocks({.num_blocks = 32, .block_size = 4, .enable_prefix_caching = true});
  SequenceTable sequences;
  Scheduler scheduler({/*max_num_seqs=*/8, /*max_num_batched_tokens=*/6, /*max_model_len=*/64},
                      blocks, sequences);
  scheduler.add(0, prompt(100, 3));
  scheduler.add(1, prompt(200, 2));
  SchedulerOutput first = scheduler.schedule();
  EXPECT_EQ(trace(first), (Trace{{0, 0, 3, true}, {1, 0, 2, true}}));
  scheduler.update_computed(first);
  scheduler.append_token(0, kPendingToken);  // seq 1's next token would end it: none pending
  scheduler.add(2, prompt(300, 9));
  SchedulerOutput second = scheduler.schedule();
  // Seq 0 decodes its pending token (the block's 4th), seq 1 is passed over, seq 2 prefills.
  EXPECT_EQ(trace(second), (Trace{{0, 3, 1, true}, {2, 0, 5, false}}));
  EXPECT_EQ(second.scheduled[0].token_ids, std::vector<int32_t>{kPendingToken});
  scheduler.check_invariants();
  scheduler.set_pending_token(0, 42);  // the launched step's sample arrived
  EXPECT_THROW(scheduler.set_pending_token(0, 43), std::invalid_argument);
  scheduler.update_computed(second);
  EXPECT_EQ(sequences.at(0).token_ids, (std::vector<int32_t>{100, 101, 102, 42}));
  // The block it completed is cached with the token's value: a prompt that starts with it hits.
  scheduler.add(3, {100, 101, 102, 42, 9});
  SchedulerOutput third = scheduler.schedule();
  EXPECT_EQ(sequences.at(3).num_computed_tokens, 4);
  scheduler.check_invariants();
  (void)third;
}

TEST(Scheduler, AdmitsByPriorityThenArrivalAndRespectsMaxNumSeqs) {
  PagedBlockManager blocks({.num_blocks = 64, .block_size = 4});
  SequenceTable sequences;
  Scheduler scheduler({2, 100, 64}, blocks, sequences);
  scheduler.add(0, prompt(1, 3), /*priority=*/1);
  scheduler.add(1, prompt(10, 3), /*priority=*/0);
  scheduler.add(2, prompt(20, 3), /*priority=*/1);
  scheduler.add(3, prompt(30, 3), /*priority=*/0);
  EXPECT_EQ(scheduler.waiting(),
            (std::vector<int64_t>{1, 3, 0, 2}));
  EXPECT_EQ(step(scheduler), (Trace{{1, 0, 3, true}, {3, 0, 3, true}}));  // max_num_seqs = 2
  scheduler.finish(3);
  EXPECT_EQ(step(scheduler), (Trace{{1, 3, 1, true}, {0, 0, 3, true}}));
}

TEST(Scheduler, PreemptsTheNewestWhenBlocksRunOutAndResumesItByRecompute) {
  // 6 usable blocks of 2 tokens; two sequences of 4-token prompts take 2 blocks each.
  PagedBlockManager blocks(
      {.num_blocks = 7, .block_size = 2, .enable_prefix_caching = false, .watermark = 0.0});
  SequenceTable sequences;
  Scheduler scheduler({4, 100, 32}, blocks, sequences);
  scheduler.add(0, prompt(1, 4));
  scheduler.add(1, prompt(50, 4));
  EXPECT_EQ(step(scheduler, 90), (Trace{{0, 0, 4, true}, {1, 0, 4, true}}));
  // Each now needs a third block for its sampled token: 2 free, fine.
  EXPECT_EQ(step(scheduler, 91), (Trace{{0, 4, 1, true}, {1, 4, 1, true}}));
  EXPECT_EQ(blocks.num_free_blocks(), 0);
  // Token 6 fits the third blocks; token 7 needs a fourth block each: seq 1 (newest) is
  // preempted to make room for seq 0, and nothing is admitted in that step.
  EXPECT_EQ(step(scheduler, 92), (Trace{{0, 5, 1, true}, {1, 5, 1, true}}));
  const SchedulerOutput out = scheduler.schedule();
  EXPECT_EQ(trace(out), (Trace{{0, 6, 1, true}}));
  EXPECT_EQ(out.preempted, (std::vector<int64_t>{1}));
  EXPECT_EQ(scheduler.num_preemptions(), 1);
  EXPECT_EQ(scheduler.sequence(1).num_computed_tokens, 0);
  EXPECT_EQ(scheduler.sequence(1).token_ids, (std::vector<int32_t>{50, 51, 52, 53, 90, 91, 92}));
  scheduler.update_computed(out);
  scheduler.append_token(0, 93);
  scheduler.check_invariants();
  // Once seq 0 finishes, seq 1 comes back and recomputes prompt + its 3 outputs in one prefill.
  EXPECT_EQ(sequences.at(1).num_admissions, 1);
  scheduler.finish(0);
  EXPECT_FALSE(sequences.contains(0));
  EXPECT_EQ(step(scheduler), (Trace{{1, 0, 7, true}}));
  EXPECT_EQ(scheduler.sequence(1).token_ids.size(), 8u);
  EXPECT_EQ(sequences.at(1).num_admissions, 2);  // readmitted: its KV is new
}

TEST(Scheduler, PassesOverSequencesWhoseAdapterWaitsForASlot) {
  PagedBlockManager blocks({.num_blocks = 32, .block_size = 4});
  SequenceTable sequences;
  Scheduler scheduler({8, 100, 64}, blocks, sequences);
  scheduler.add(0, prompt(1, 5), 0, 9, Scheduler::kLoraPending);
  scheduler.add(1, prompt(40, 3), 0, 9, /*lora_slot=*/0, /*cache_key=*/3);
  // The first in line waits for its adapter; the one behind it runs.
  EXPECT_EQ(step(scheduler), (Trace{{1, 0, 3, true}}));
  EXPECT_EQ(scheduler.waiting(), (std::vector<int64_t>{0}));
  EXPECT_EQ(step(scheduler), (Trace{{1, 3, 1, true}}));
  scheduler.set_lora(0, /*lora_slot=*/1, /*cache_key=*/7);
  EXPECT_EQ(sequences.at(0).cache_key, 7u);
  const SchedulerOutput out = scheduler.schedule();
  ASSERT_EQ(out.scheduled.size(), 2u);
  EXPECT_EQ(out.scheduled[1].seq_id, 0);
  EXPECT_EQ(out.scheduled[1].lora_slot, 1);
  scheduler.update_computed(out);
  // A sequence that holds blocks keeps its adapter.
  EXPECT_THROW(scheduler.set_lora(0, 0, 0), std::logic_error);
  EXPECT_THROW(scheduler.set_lora(9, 0, 0), std::out_of_range);
  scheduler.check_invariants();
}

TEST(Scheduler, KeepsItsSequencesInTheSharedTable) {
  PagedBlockManager blocks({.num_blocks = 32, .block_size = 4});
  SequenceTable sequences;
  Scheduler scheduler({8, 100, 64}, blocks, sequences);
  scheduler.add(0, prompt(1, 6), /*priority=*/0, /*max_new_tokens=*/9, /*lora_slot=*/2, 5);
  EXPECT_EQ(sequences.size(), 1);
  EXPECT_EQ(&scheduler.sequence(0), &sequences.at(0));
  const SequenceState& s = sequences.at(0);
  EXPECT_EQ(s.token_ids, prompt(1, 6));
  EXPECT_EQ(s.num_prompt_tokens, 6);
  EXPECT_EQ(s.max_new_tokens, 9);
  EXPECT_EQ(s.lora_slot, 2);
  EXPECT_EQ(s.cache_key, 5u);
  EXPECT_EQ(s.num_admissions, 0);
  const SchedulerOutput out = scheduler.schedule();
  ASSERT_EQ(out.scheduled.size(), 1u);
  EXPECT_EQ(out.scheduled[0].token_ids, prompt(1, 6));
  EXPECT_EQ(out.scheduled[0].block_tables,
            (std::vector<std::vector<int32_t>>{blocks.block_table(0)}));
  EXPECT_EQ(out.scheduled[0].lora_slot, 2);
  scheduler.update_computed(out);
  scheduler.append_token(0, 99);
  EXPECT_EQ(s.num_computed_tokens, 6);
  EXPECT_EQ(s.num_output_tokens(), 1);
  scheduler.fork(0, 1);
  EXPECT_EQ(sequences.at(1).token_ids, sequences.at(0).token_ids);
  EXPECT_EQ(sequences.at(1).seq_id, 1);
  // An id the table holds is taken, even if the scheduler never saw it.
  sequences.add({.seq_id = 7, .token_ids = {1}});
  EXPECT_THROW(scheduler.add(7, prompt(1, 3)), std::invalid_argument);
  sequences.erase(7);
  EXPECT_THROW(sequences.erase(7), std::out_of_range);
  EXPECT_THROW(sequences.at(7), std::out_of_range);
  scheduler.finish(0);
  scheduler.finish(1);
  EXPECT_EQ(sequences.size(), 0);
  scheduler.check_invariants();
}

TEST(Scheduler, PrefixHitsStartTheFirstChunkAfterTheCachedTokens) {
  PagedBlockManager blocks({.num_blocks = 32, .block_size = 4});
  SequenceTable sequences;
  Scheduler scheduler({8, 100, 64}, blocks, sequences);
  scheduler.add(0, prompt(1, 10));
  step(scheduler);
  scheduler.add(1, prompt(1, 10));
  EXPECT_EQ(step(scheduler), (Trace{{0, 10, 1, true}, {1, 8, 2, true}}));
  EXPECT_EQ(scheduler.sequence(1).num_cached_tokens, 8);
}

TEST(Scheduler, LoadedPromptsWaitWithTheirBlocksThenDecode) {
  PagedBlockManager blocks({.num_blocks = 32, .block_size = 4});
  SequenceTable sequences;
  Scheduler scheduler({8, 100, 64}, blocks, sequences);
  scheduler.add(0, prompt(1, 10));
  step(scheduler);  // seq 0's prompt cached: blocks of tokens 1..8 hit below
  scheduler.add(1, prompt(1, 14), 0, 8, -1, 0, /*load_prompt=*/true);
  scheduler.add(2, prompt(50, 6), 0, 8, -1, 0, /*load_prompt=*/true);
  SchedulerOutput out = scheduler.schedule();
  // Admitted without compute: blocks for whole prompts (the hit included), nothing scheduled.
  EXPECT_EQ(trace(out), (Trace{{0, 10, 1, true}}));
  EXPECT_EQ(out.loads, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(scheduler.sequence(1).num_cached_tokens, 8);
  EXPECT_EQ(blocks.block_table(1).size(), 4u);
  EXPECT_EQ(scheduler.num_loading(), 2);
  scheduler.update_computed(out);
  scheduler.append_token(0, 7);
  scheduler.check_invariants();
  // A load that ends: the prompt counts as computed and the sequence decodes its first token.
  EXPECT_TRUE(scheduler.end_load(1, true));
  scheduler.append_token(1, 9);
  EXPECT_EQ(step(scheduler), (Trace{{0, 11, 1, true}, {1, 14, 1, true}}));
  // A load that fails frees its blocks; one finished while loading keeps them until it ends.
  const int64_t free_before = blocks.num_free_blocks();
  scheduler.finish(2);
  EXPECT_EQ(blocks.num_free_blocks(), free_before);
  scheduler.check_invariants();
  EXPECT_FALSE(scheduler.end_load(2, true));
  EXPECT_EQ(blocks.num_free_blocks(), free_before + 2);
  EXPECT_THROW(scheduler.end_load(2, true), std::out_of_range);
  scheduler.check_invariants();
}

TEST(Scheduler, HeldSequencesKeepTheirBlocksUntilReleased) {
  PagedBlockManager blocks({.num_blocks = 16, .block_size = 4});
  SequenceTable sequences;
  Scheduler scheduler({8, 100, 64}, blocks, sequences);
  scheduler.add(0, prompt(1, 9));
  step(scheduler);
  const std::vector<int32_t> table = blocks.block_table(0);
  scheduler.hold(0);
  EXPECT_FALSE(scheduler.has_sequence(0));
  EXPECT_FALSE(scheduler.has_pending_work());
  EXPECT_EQ(scheduler.num_held(), 1);
  EXPECT_EQ(blocks.block_table(0), table);
  for (int32_t b : table) EXPECT_EQ(blocks.ref_count(b), 1);
  scheduler.check_invariants();
  EXPECT_THROW(scheduler.hold(0), std::out_of_range);
  scheduler.release(0);
  EXPECT_EQ(blocks.num_free_blocks(), blocks.num_usable_blocks());
  EXPECT_THROW(scheduler.release(0), std::out_of_range);
  scheduler.check_invariants();
}

TEST(Scheduler, PrefixHitsOnlyUnderTheSameCacheKey) {
  // One key per LoRA adapter: the same prompt under another adapter has other K/V.
  PagedBlockManager blocks({.num_blocks = 32, .block_size = 4});
  SequenceTable sequences;
  Scheduler scheduler({8, 100, 64}, blocks, sequences);
  scheduler.add(0, prompt(1, 10), 0, 100, /*lora_slot=*/1, /*cache_key=*/77);
  step(scheduler);
  scheduler.add(1, prompt(1, 10));                        // the base model: no hit
  scheduler.add(2, prompt(1, 10), 0, 100, 0, /*cache_key=*/78);
  scheduler.add(3, prompt(1, 10), 0, 100, 1, /*cache_key=*/77);
  step(scheduler);
  EXPECT_EQ(scheduler.sequence(1).num_cached_tokens, 0);
  EXPECT_EQ(scheduler.sequence(2).num_cached_tokens, 0);
  EXPECT_EQ(scheduler.sequence(3).num_cached_tokens, 8);
  EXPECT_EQ(scheduler.sequence(0).lora_slot, 1);
  EXPECT_EQ(scheduler.sequence(1).lora_slot, -1);
  EXPECT_EQ(scheduler.sequence(2).lora_slot, 0);
}

TEST(Scheduler, SequencesAdmittedInOneStepShareTheFirstOnesBlocks) {
  PagedBlockManager blocks({.num_blocks = 32, .block_size = 4});
  SequenceTable sequences;
  Scheduler scheduler({8, 100, 64}, blocks, sequences);
  scheduler.add(0, prompt(1, 10));
  scheduler.add(1, prompt(1, 10));
  scheduler.add(2, prompt(1, 3));  // shorter than a block: nothing to share
  EXPECT_EQ(step(scheduler), (Trace{{0, 0, 10, true}, {1, 8, 2, true}, {2, 0, 3, true}}));
  EXPECT_EQ(blocks.block_table(1)[0], blocks.block_table(0)[0]);
  EXPECT_EQ(blocks.block_table(1)[1], blocks.block_table(0)[1]);
}

TEST(Scheduler, ForkedSequencesRunOnTheirOwn) {
  PagedBlockManager blocks({.num_blocks = 32, .block_size = 4});
  SequenceTable sequences;
  Scheduler scheduler({8, 100, 64}, blocks, sequences);
  scheduler.add(0, prompt(1, 6));
  SchedulerOutput out = scheduler.schedule();
  scheduler.update_computed(out);
  scheduler.fork(0, 1);
  scheduler.append_token(0, 100);
  scheduler.append_token(1, 200);
  out = scheduler.schedule();
  EXPECT_EQ(trace(out), (Trace{{0, 6, 1, true}, {1, 6, 1, true}}));
  // The shared half-full block is copied for the first writer.
  ASSERT_EQ(out.block_copies.size(), 1u);
  EXPECT_EQ(blocks.block_table(0)[1], out.block_copies[0].dst);
  scheduler.update_computed(out);
  scheduler.check_invariants();
}

TEST(Scheduler, RejectsSequencesThatCanNeverRun) {
  PagedBlockManager blocks({.num_blocks = 4, .block_size = 4});  // 12 tokens
  SequenceTable sequences;
  Scheduler scheduler({8, 100, 16}, blocks, sequences);
  EXPECT_THROW(scheduler.add(0, {}), std::invalid_argument);
  EXPECT_THROW(scheduler.add(0, prompt(1, 17)), std::invalid_argument);  // > max_model_len
  EXPECT_THROW(scheduler.add(0, prompt(1, 13)), std::invalid_argument);  // > the pool
  EXPECT_THROW(scheduler.add(0, {1, -2}), std::invalid_argument);
  scheduler.add(0, prompt(1, 12));
  EXPECT_THROW(scheduler.add(0, prompt(1, 2)), std::invalid_argument);  // duplicate id
  EXPECT_THROW(Scheduler({0, 100, 16}, blocks, sequences), std::invalid_argument);
  EXPECT_THROW(scheduler.finish(42), std::out_of_range);
}

TEST(Scheduler, RandomizedRunKeepsInvariantsAndFinishesEverything) {
  for (int seed = 0; seed < 3; ++seed) {
    std::mt19937 rng(seed);
    PagedBlockManager blocks(
        {.num_blocks = 24, .block_size = 4, .enable_prefix_caching = seed != 1});
    SequenceTable sequences;
    Scheduler scheduler({6, 16, 48}, blocks, sequences);
    std::map<int64_t, int64_t> target_len;  // seq id -> total tokens at which it finishes
    int64_t next_id = 0, finished = 0, steps = 0;
    while (next_id < 60 || scheduler.has_pending_work()) {
      if (next_id < 60 && rng() % 2 == 0) {
        const int64_t len = 1 + rng() % 20;
        std::vector<int32_t> p(len);
        for (auto& t : p) t = static_cast<int32_t>(rng() % 3);  // shared prefixes are common
        target_len[next_id] = len + 1 + rng() % 20;
        scheduler.add(next_id++, p, static_cast<int64_t>(rng() % 2));
      }
      SchedulerOutput out = scheduler.schedule();
      int64_t tokens = 0;
      for (const auto& s : out.scheduled) {
        tokens += s.num_new_tokens;
        const auto& all = scheduler.sequence(s.seq_id).token_ids;
        ASSERT_EQ(s.token_ids,
                  std::vector<int32_t>(all.begin() + s.num_computed,
                                       all.begin() + s.num_computed + s.num_new_tokens));
        ASSERT_EQ(s.block_tables,
                  (std::vector<std::vector<int32_t>>{blocks.block_table(s.seq_id)}));
      }
      ASSERT_LE(tokens, 16);
      ASSERT_EQ(tokens, out.num_batched_tokens);
      scheduler.update_computed(out);
      for (const auto& s : out.scheduled) {
        if (!s.samples) continue;
        const int64_t len = static_cast<int64_t>(scheduler.sequence(s.seq_id).token_ids.size());
        if (len >= target_len[s.seq_id] || rng() % 50 == 0) {  // done, or aborted
          scheduler.finish(s.seq_id);
          ++finished;
        } else {
          scheduler.append_token(s.seq_id, static_cast<int32_t>(rng() % 3));
        }
      }
      scheduler.check_invariants();
      ASSERT_LT(++steps, 5000) << "the scheduler stopped making progress";
    }
    EXPECT_EQ(finished, 60);
    EXPECT_EQ(blocks.num_free_blocks(), blocks.num_usable_blocks());
    if (seed == 0) EXPECT_GT(scheduler.num_preemptions(), 0);
  }
}

}  // namespace
}  // namespace kvserve
