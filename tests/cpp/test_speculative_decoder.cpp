// Speculative decoding in C++: draft slots in the block manager (grow, shrink, copy-on-write) and
// the scheduler (budget, limits, never preempting), n-gram lookup, and the engine with a draft that
// is the target itself (greedy output identical to plain decoding, nearly every draft accepted).
#include "kvserve/speculative_decoder.h"

#include <gtest/gtest.h>

#include <unordered_map>

#include "kvserve/continuous_batching_engine.h"
#include "kvserve/ngram_proposer.h"
#include "kvserve/paged_block_manager.h"
#include "kvserve/scheduler.h"
#include "models/model_factory.h"
#include "tiny_model.h"

namespace kvserve {
namespace {

using Ids = std::vector<int32_t>;

TEST(PagedBlockManagerLookahead, ReservesShrinksAndFreesDraftSlots) {
  PagedBlockManager m({.num_blocks = 8, .block_size = 4, .watermark = 0.0});
  m.allocate(1, {1, 2, 3, 4, 5});  // blocks 1, 2
  EXPECT_TRUE(m.can_append_slots(1, 1, 5));
  EXPECT_TRUE(m.append_slots(1, {6}, 5).empty());  // 6 tokens + 5 slots = 11: blocks 1, 2, 3
  EXPECT_EQ(m.block_table(1), (Ids{1, 2, 3}));
  EXPECT_EQ(m.num_lookahead(1), 5);
  EXPECT_EQ(m.num_tokens(1), 6);
  m.check_invariants();
  m.mark_computed(1, 6);
  // Two drafts accepted: they become tokens in the slots already held.
  m.append_slots(1, {7, 8}, 3);
  EXPECT_EQ(m.block_table(1), (Ids{1, 2, 3}));
  // The rest rejected: 8 tokens and no slot fit in two blocks; block 3 goes back to the front.
  m.append_slots(1, {}, 0);
  EXPECT_EQ(m.block_table(1), (Ids{1, 2}));
  EXPECT_EQ(m.free_block_ids().front(), 3);
  EXPECT_TRUE(m.can_append_slots(1, 1, 17));   // 26 positions: 7 blocks = 2 held + 5 free
  EXPECT_FALSE(m.can_append_slots(1, 1, 21));  // 30 positions: 8 blocks
  m.check_invariants();
  m.free(1);
  EXPECT_EQ(m.num_free_blocks(), 7);
}

TEST(PagedBlockManagerLookahead, SlotsInASharedPartialBlockCopyItFirst) {
  PagedBlockManager m({.num_blocks = 8, .block_size = 4, .watermark = 0.0});
  m.allocate(1, {1, 2, 3, 4, 5, 6});  // blocks 1, 2 (2 is partial)
  m.mark_computed(1, 6);
  m.fork(1, 2);
  // The child writes its draft slots into the shared partial block: it gets its own copy.
  const auto copies = m.append_slots(2, {}, 3);
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0].src, 2);
  EXPECT_EQ(m.block_table(2)[1], copies[0].dst);
  EXPECT_EQ(m.block_table(1), (Ids{1, 2}));
  m.check_invariants();
  // A fork shares the tokens' blocks, not the parent's draft slots.
  m.append_slots(1, {9}, 6);
  m.fork(1, 3);
  EXPECT_EQ(m.num_lookahead(3), 0);
  EXPECT_EQ(m.block_table(3).size(), 2u);
  m.check_invariants();
}


// Runs one step of `scheduler` with k draft slots; every sampling sequence gets `accepted` of its
// drafts accepted (tokens 100, 101, ...) and then one new token.
SchedulerOutput step(Scheduler& scheduler, int64_t k, int64_t accepted = 0) {
  SchedulerOutput out = scheduler.schedule(k);
  scheduler.update_computed(out);
  for (const auto& s : out.scheduled) {
    if (!s.samples) continue;
    for (int64_t j = 0; j < std::min(accepted, s.num_speculative_tokens); ++j) {
      scheduler.append_token(s.seq_id, static_cast<int32_t>(100 + j), /*kv_written=*/true);
    }
    scheduler.append_token(s.seq_id, 7);
  }
  scheduler.check_invariants();
  return out;
}

TEST(SchedulerDraftSlots, DecodesGetSlotsWithinBudgetAndLimits) {
  PagedBlockManager blocks({.num_blocks = 64, .block_size = 4, .watermark = 0.0});
  SequenceTable sequences;
  Scheduler scheduler(SchedulerConfig{8, 12, 64}, blocks, sequences);
  scheduler.add(0, {1, 2, 3, 4, 5}, 0, /*max_new_tokens=*/6);
  scheduler.add(1, {1, 9, 8}, 0, 100);
  SchedulerOutput out = step(scheduler, 4);  // prefills: no drafts for the prompts' first samples
  for (const auto& s : out.scheduled) EXPECT_EQ(s.num_speculative_tokens, 0);
  out = step(scheduler, 4, /*accepted=*/2);
  ASSERT_EQ(out.scheduled.size(), 2u);
  EXPECT_EQ(out.scheduled[0].num_speculative_tokens, 4);  // 1 output, 6 allowed: 4 + 1 fit
  EXPECT_EQ(out.scheduled[1].num_speculative_tokens, 4);
  EXPECT_EQ(out.num_batched_tokens, 10);
  // Sequence 0 holds 4 outputs (1 + 2 accepted + 1): only 6 - 4 - 1 = 1 draft fits its limit;
  // the budget of 12 leaves sequence 1 with 12 - 2 - 1 = 9 >= 4.
  out = step(scheduler, 4);
  EXPECT_EQ(out.scheduled[0].num_speculative_tokens, 1);
  EXPECT_EQ(out.scheduled[1].num_speculative_tokens, 4);
  // Prompt, the first sample, two accepted drafts, then the token sampled after them.
  EXPECT_EQ(scheduler.sequence(1).num_computed_tokens, 3 + 1 + 2 + 1);
}

TEST(SchedulerDraftSlots, SpeculationNeverPreempts) {
  PagedBlockManager blocks(
      {.num_blocks = 5, .block_size = 4, .watermark = 0.0});  // 4 usable blocks
  SequenceTable sequences;
  Scheduler scheduler(SchedulerConfig{8, 64, 64}, blocks, sequences);
  scheduler.add(0, {1, 2, 3, 4, 5, 6, 7}, 0);
  scheduler.add(1, {1, 2, 9, 9, 9, 9, 9}, 0);
  step(scheduler, 0);  // 2 + 2 blocks: the pool is full
  const SchedulerOutput out = step(scheduler, 3);
  EXPECT_TRUE(out.preempted.empty());
  ASSERT_EQ(out.scheduled.size(), 2u);
  for (const auto& s : out.scheduled) EXPECT_EQ(s.num_speculative_tokens, 0);
}

TEST(SchedulerDraftSlots, AcceptedTokensNeedAReservedSlot) {
  PagedBlockManager blocks({.num_blocks = 16, .block_size = 4, .watermark = 0.0});
  SequenceTable sequences;
  Scheduler scheduler(SchedulerConfig{8, 64, 64}, blocks, sequences);
  scheduler.add(0, {1, 2, 3}, 0);
  step(scheduler, 2);
  EXPECT_THROW(scheduler.append_token(0, 5, /*kv_written=*/true), std::logic_error);
}

TEST(NgramProposer, ProposesWhatFollowedTheLatestLongestMatch) {
  const NgramProposer ngram(1, 3);
  // Suffix [4, 5, 6] occurs at 1..3 (followed by 9, 9) and [5, 6] at 6..7 (followed by 1).
  EXPECT_EQ(ngram.lookup({3, 4, 5, 6, 9, 9, 5, 6, 1, 4, 5, 6}, 2), (std::vector<int64_t>{9, 9}));
  // Only [6] recurs: the latest occurrence wins.
  EXPECT_EQ(ngram.lookup({6, 1, 2, 6, 3, 8, 6}, 4), (std::vector<int64_t>{3, 8, 6}));
  EXPECT_TRUE(NgramProposer(2, 3).lookup({6, 1, 2, 6, 3, 8, 6}, 4).empty());
  EXPECT_TRUE(ngram.lookup({1, 2, 3}, 4).empty());
  EXPECT_TRUE(ngram.lookup({5}, 4).empty());
  EXPECT_THROW(NgramProposer(0, 2), std::invalid_argument);
}

std::unordered_map<std::string, std::vector<int64_t>> generate(ContinuousBatchingEngine& engine) {
  const std::vector<std::vector<int64_t>> prompts = {{1, 5, 9}, {3, 3, 3, 3, 3, 3, 3}, {7}};
  for (size_t i = 0; i < prompts.size(); ++i) {
    engine.add_request(std::to_string(i), prompts[i], greedy(20 + static_cast<int64_t>(i)));
  }
  std::unordered_map<std::string, std::vector<int64_t>> tokens;
  for (int step = 0; step < 200 && engine.has_unfinished_requests(); ++step) {
    for (RequestOutput& out : engine.step()) {
      if (out.finished) tokens[out.request_id] = out.outputs.at(0).token_ids;
    }
    engine.scheduler().check_invariants();
  }
  EXPECT_FALSE(engine.has_unfinished_requests());
  return tokens;
}

TEST(SpeculativeDecoder, TheTargetAsItsOwnDraftKeepsGreedyOutputAndAcceptsNearlyAll) {
  auto model = create_causal_lm(tiny_config(), tiny_weights(tiny_config()), 64);
  EngineConfig config;
  config.max_model_len = 64;
  config.block_size = 4;
  config.num_blocks = 64;
  ContinuousBatchingEngine plain(model, config);
  const auto want = generate(plain);
  for (const char* method : {"draft_model", "ngram"}) {
    config.speculative = SpeculativeConfig{method, 3};
    ContinuousBatchingEngine speculative(model, config,
                                         std::string(method) == "ngram" ? nullptr : model);
    EXPECT_EQ(generate(speculative), want) << method;
    const EngineStats stats = speculative.get_stats();
    EXPECT_GT(stats.num_drafts, 0) << method;
    if (std::string(method) == "draft_model") {
      EXPECT_GT(stats.num_accepted_tokens, stats.num_draft_tokens * 9 / 10);
    }
    EXPECT_EQ(speculative.block_manager().num_free_blocks(),
              speculative.block_manager().num_usable_blocks());
  }
}

TEST(SpeculativeDecoder, CreateRejectsMismatchedDraftsAndBadConfigs) {
  auto model = create_causal_lm(tiny_config(), tiny_weights(tiny_config()), 64);
  ModelConfig other = tiny_config();
  other.vocab_size = 80;
  auto wrong_vocab = create_causal_lm(other, tiny_weights(other), 64);
  EXPECT_THROW(SpeculativeDecoder::create({"draft_model", 2}, *model, wrong_vocab, 8, 4, 64),
               std::invalid_argument);
  EXPECT_THROW(SpeculativeDecoder::create({"draft_model", 2}, *model, nullptr, 8, 4, 64),
               std::invalid_argument);
  EXPECT_THROW(SpeculativeDecoder::create({"ngram", 2}, *model, model, 8, 4, 64),
               std::invalid_argument);
  EXPECT_THROW(SpeculativeDecoder::create({"ngram", 0}, *model, nullptr, 8, 4, 64),
               std::invalid_argument);
  EXPECT_THROW(SpeculativeDecoder::create({"medusa", 2}, *model, nullptr, 8, 4, 64),
               std::invalid_argument);
  // MTP drafts with an MtpHead (the target checkpoint's modules), not with a plain model.
  EXPECT_THROW(SpeculativeDecoder::create({"mtp", 2}, *model, model, 8, 4, 64),
               std::invalid_argument);
  EXPECT_THROW(SpeculativeDecoder::create({"mtp", 2}, *model, nullptr, 8, 4, 64),
               std::invalid_argument);
  EXPECT_THROW(SpeculativeDecoder::create({"draft_model", 2}, *model, model, 8, 4, 1000),
               std::invalid_argument);  // the draft handles 128 positions
  EXPECT_EQ(SpeculativeDecoder::create({}, *model, nullptr, 8, 4, 64), nullptr);
  SpeculativeConfig paused{"ngram", 4, 1, 4, 8};
  const auto decoder = SpeculativeDecoder::create(paused, *model, nullptr, 8, 4, 64);
  EXPECT_EQ(decoder->num_speculative_tokens(7), 4);
  EXPECT_EQ(decoder->num_speculative_tokens(8), 0);
  SpeculativeConfig budget{"ngram", 4, 1, 4, 0, /*max_verify_tokens=*/8};
  const auto shrinking = SpeculativeDecoder::create(budget, *model, nullptr, 8, 4, 64);
  const std::vector<int64_t> want = {4, 4, 3, 1, 1, 0, 0, 0};  // min(4, 8 / running - 1)
  for (int64_t running = 0; running < 8; ++running) {
    EXPECT_EQ(shrinking->num_speculative_tokens(running), want[running]) << running;
  }
}

}  // namespace
}  // namespace kvserve
