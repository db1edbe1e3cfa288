// ModelRunner (one forward over a scheduled step, logits at chosen positions, sampling) and the
// model factory, over a tiny random Llama built in C++.
#include "kvserve/model_runner.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/randn.h>
#include <gtest/gtest.h>

#include <limits>
#include <optional>
#include <stdexcept>

#include "models/model_factory.h"
#include "tiny_model.h"

namespace kvserve {
namespace {

// A scheduler over its own pool and sequences, one sequence per prompt, and a runner.
struct Harness {
  explicit Harness(std::shared_ptr<CausalLM> model, int64_t budget = 64)
      : blocks({.num_blocks = 64, .block_size = 4, .enable_prefix_caching = false}),
        scheduler(SchedulerConfig{8, budget, 32}, blocks, sequences),
        runner(std::move(model), sequences, {.num_blocks = 64, .block_size = 4}) {}

  PagedBlockManager blocks;
  SequenceTable sequences;
  Scheduler scheduler;
  ModelRunner runner;
};

std::shared_ptr<CausalLM> tiny_model() {
  return create_causal_lm(tiny_config(), tiny_weights(tiny_config()), 32);
}

SamplingParams greedy() {
  SamplingParams p;
  p.temperature = 0.0;
  return p;
}

// Greedy targets at `positions` of scheduled sequence `index`.
std::vector<SamplingTarget> targets_at(int64_t index, const std::vector<int64_t>& positions,
                                       const SamplingParams& params, RequestRandom& random) {
  std::vector<SamplingTarget> targets;
  for (int64_t p : positions) targets.push_back({index, p, SamplingRow{&params, &random}});
  return targets;
}

TEST(ModelRunner, LogitsAtEveryPositionEqualEachPrefixAsTheLastToken) {
  const std::vector<int32_t> prompt = {1, 5, 9, 11, 3, 7, 2};
  const SamplingParams params = greedy();
  RequestRandom random(0);
  auto model = tiny_model();
  Harness all(model);
  all.scheduler.add(0, prompt);
  const SchedulerOutput work = all.scheduler.schedule();
  ASSERT_EQ(work.scheduled.size(), 1u);
  const auto out = all.runner.execute(work, targets_at(0, {0, 1, 2, 3, 4, 5, 6}, params, random));
  ASSERT_EQ(out.samples.size(), prompt.size());
  for (size_t p = 0; p < prompt.size(); ++p) {
    Harness one(model);
    one.scheduler.add(0, std::vector<int32_t>(prompt.begin(), prompt.begin() + p + 1));
    const SchedulerOutput w = one.scheduler.schedule();
    const auto last = one.runner.execute(w, targets_at(0, {static_cast<int64_t>(p)}, params, random));
    EXPECT_EQ(out.samples[p].token_ids, last.samples[0].token_ids) << "position " << p;
  }
}

TEST(ModelRunner, ChunkedPrefillAndBatchingDoNotChangeTheTokens) {
  const SamplingParams params = greedy();
  RequestRandom random(0);
  auto model = tiny_model();
  Harness alone(model);
  alone.scheduler.add(0, {4, 8, 15, 16, 23, 42, 9, 1, 3});
  const SchedulerOutput w = alone.scheduler.schedule();
  const int64_t want = alone.runner.execute(w, targets_at(0, {8}, params, random)).samples[0].token_ids[0];

  Harness chunked(model, /*budget=*/4);  // 4 tokens per step: the prompt runs in 3 steps
  chunked.scheduler.add(7, {1, 2});
  chunked.scheduler.add(0, {4, 8, 15, 16, 23, 42, 9, 1, 3});
  int64_t got = -2;
  for (int step = 0; step < 5 && got == -2; ++step) {
    const SchedulerOutput work = chunked.scheduler.schedule();
    std::vector<SamplingTarget> targets;
    for (size_t i = 0; i < work.scheduled.size(); ++i) {
      const ScheduledSequence& s = work.scheduled[i];
      if (s.seq_id == 0 && s.samples) {
        targets = targets_at(static_cast<int64_t>(i), {s.num_new_tokens - 1}, params, random);
      }
    }
    const auto out = chunked.runner.execute(work, targets);
    chunked.scheduler.update_computed(work);
    if (step == 0) chunked.scheduler.finish(7);  // its prompt ran beside the first chunk
    if (!targets.empty()) got = out.samples[0].token_ids[0];
  }
  EXPECT_EQ(got, want);
}

TEST(ModelRunner, RunsAStepFromItsSchedulerOutputAlone) {
  // The runner of another engine, whose sequence table never heard of the sequences, runs the
  // step from what the SchedulerOutput carries and samples what the scheduler's own runner does.
  const SamplingParams params = greedy();
  RequestRandom random(0);
  auto model = tiny_model();
  Harness h(model, /*budget=*/5);
  h.scheduler.add(0, {4, 8, 15, 16, 23, 42, 9});
  h.scheduler.add(1, {5, 6});
  SequenceTable empty;
  ModelRunner stranger(model, empty, {.num_blocks = 64, .block_size = 4});
  for (int step = 0; step < 3; ++step) {
    const SchedulerOutput work = h.scheduler.schedule();
    std::vector<SamplingTarget> targets;
    for (size_t i = 0; i < work.scheduled.size(); ++i) {
      const ScheduledSequence& s = work.scheduled[i];
      const SequenceState& state = h.scheduler.sequence(s.seq_id);
      EXPECT_EQ(s.token_ids, std::vector<int32_t>(state.token_ids.begin() + s.num_computed,
                                                  state.token_ids.begin() + s.num_computed +
                                                      s.num_new_tokens));
      EXPECT_EQ(s.block_tables, std::vector<std::vector<int32_t>>{h.blocks.block_table(s.seq_id)});
      if (s.samples) {
        for (auto& t :
             targets_at(static_cast<int64_t>(i), {s.num_new_tokens - 1}, params, random)) {
          targets.push_back(t);
        }
      }
    }
    const auto own = h.runner.execute(work, targets);
    const auto other = stranger.execute(work, targets);
    ASSERT_EQ(own.samples.size(), other.samples.size());
    for (size_t t = 0; t < own.samples.size(); ++t) {
      EXPECT_EQ(own.samples[t].token_ids, other.samples[t].token_ids) << "step " << step;
    }
    h.scheduler.update_computed(work);
    for (const auto& s : work.scheduled) {
      if (s.samples) h.scheduler.append_token(s.seq_id, 3);
    }
  }
}

// Asynchronous scheduling: steps launched back to back, each fed the last one's samples on the
// device (the scheduled token a kPendingToken), give the synchronous steps' tokens and logprobs.
TEST(ModelRunner, LaunchedStepsFedOnTheDeviceEqualExecutedSteps) {
  SamplingParams params = greedy();
  params.logprobs = 3;
  RequestRandom random(0);
  auto model = tiny_model();
  const std::vector<std::vector<int32_t>> prompts = {{1, 5, 9}, {4, 8, 15, 16, 23}};
  Harness sync(model), launched(model);
  for (size_t i = 0; i < prompts.size(); ++i) {
    sync.scheduler.add(static_cast<int64_t>(i), prompts[i]);
    launched.scheduler.add(static_cast<int64_t>(i), prompts[i]);
  }
  std::optional<LaunchedStep> in_flight;
  for (int step = 0; step < 5; ++step) {
    const SchedulerOutput want_work = sync.scheduler.schedule();
    const auto want = sync.runner.execute(
        want_work, {{0, want_work.scheduled[0].num_new_tokens - 1, SamplingRow{&params, &random}},
                    {1, want_work.scheduled[1].num_new_tokens - 1, SamplingRow{&params, &random}}});
    sync.scheduler.update_computed(want_work);
    for (int64_t i = 0; i < 2; ++i) {
      sync.scheduler.append_token(i, static_cast<int32_t>(want.samples[i].token_ids[0]));
    }
    const SchedulerOutput work = launched.scheduler.schedule();
    TokenFeed feed;
    if (in_flight) {
      feed.tokens = in_flight->samples.token_ids;
      feed.rows = {0, 1};  // each sequence decodes its pending token
      feed.sources = {0, 1};
      EXPECT_EQ(work.scheduled[1].token_ids, std::vector<int32_t>{kPendingToken});
    }
    LaunchedStep next = launched.runner.launch(
        work, {{0, work.scheduled[0].num_new_tokens - 1, SamplingRow{&params, &random}},
               {1, work.scheduled[1].num_new_tokens - 1, SamplingRow{&params, &random}}},
        {}, feed);
    if (in_flight) {
      const auto got = launched.runner.finish(*in_flight);
      for (int64_t i = 0; i < 2; ++i) {
        launched.scheduler.set_pending_token(i, static_cast<int32_t>(got.samples[i].token_ids[0]));
      }
    }
    launched.scheduler.update_computed(work);
    for (int64_t i = 0; i < 2; ++i) launched.scheduler.append_token(i, kPendingToken);
    in_flight.emplace(std::move(next));
    // The step just launched is the synchronous one: compare once its samples are in.
    const auto got = launched.runner.finish(*in_flight);
    for (int64_t i = 0; i < 2; ++i) {
      EXPECT_EQ(got.samples[i].token_ids, want.samples[i].token_ids) << "step " << step;
      ASSERT_TRUE(got.samples[i].logprobs[0] && want.samples[i].logprobs[0]);
      EXPECT_EQ(got.samples[i].logprobs[0]->top, want.samples[i].logprobs[0]->top);
      EXPECT_EQ(got.samples[i].logprobs[0]->rank, want.samples[i].logprobs[0]->rank);
    }
  }
  // A pending token that no feed fills is refused before the forward.
  const SchedulerOutput unfed = launched.scheduler.schedule();
  EXPECT_THROW(launched.runner.launch(unfed, {}, {}, TokenFeed{}), std::logic_error);
  EXPECT_THROW(launched.runner.execute(unfed, {}), std::logic_error);
}

TEST(ModelRunner, RejectsAScheduledSequenceWithoutItsTokensOrTables) {
  Harness h(tiny_model());
  h.scheduler.add(0, {1, 2, 3});
  SchedulerOutput work = h.scheduler.schedule();
  work.scheduled[0].token_ids.pop_back();
  EXPECT_THROW(h.runner.execute(work, {}), std::invalid_argument);
  work.scheduled[0].token_ids.push_back(3);
  work.scheduled[0].block_tables.push_back(work.scheduled[0].block_tables[0]);
  EXPECT_THROW(h.runner.execute(work, {}), std::invalid_argument);
}

TEST(ModelRunner, SamplesThatShareAPositionReadTheSameLogits) {
  SamplingParams sampled;
  sampled.temperature = 1.0;
  sampled.seed = 3;
  RequestRandom a(3), b(3), c(4);
  Harness h(tiny_model());
  h.scheduler.add(0, {1, 2, 3});
  const SchedulerOutput work = h.scheduler.schedule();
  const std::vector<SamplingTarget> targets = {{0, 2, SamplingRow{&sampled, &a}},
                                               {0, 2, SamplingRow{&sampled, &b}},
                                               {0, 2, SamplingRow{&sampled, &c}}};
  const auto out = h.runner.execute(work, targets);
  ASSERT_EQ(out.samples.size(), 3u);
  EXPECT_EQ(out.samples[0].token_ids, out.samples[1].token_ids);  // same logits, same stream
  for (const SampledTokens& s : out.samples) EXPECT_EQ(s.logprobs.size(), 1u);
}

TEST(ModelRunner, RejectsAPositionOutsideTheStep) {
  const SamplingParams params = greedy();
  RequestRandom random(0);
  Harness h(tiny_model());
  h.scheduler.add(0, {1, 2, 3});
  const SchedulerOutput work = h.scheduler.schedule();
  EXPECT_THROW(h.runner.execute(work, targets_at(0, {3}, params, random)), std::out_of_range);
}

TEST(ModelRunner, PromptLogprobsAreTheLogprobsSamplingSeesAtEachPosition) {
  const std::vector<int32_t> prompt = {1, 5, 9, 11, 3, 7, 2};
  SamplingParams params = greedy();
  params.logprobs = 3;
  RequestRandom random(0);
  Harness h(tiny_model());
  h.scheduler.add(0, prompt);
  const SchedulerOutput work = h.scheduler.schedule();
  // Positions 1..5 score tokens 2..6; the same positions are also sampled with logprobs.
  const std::vector<PromptLogprobsTarget> scored = {{0, 1, {9, 11, 3, 7, 2}, 3}};
  const auto out = h.runner.execute(work, targets_at(0, {1, 2, 3, 4, 5}, params, random), scored);
  ASSERT_EQ(out.prompt_logprobs.size(), 1u);
  ASSERT_EQ(out.prompt_logprobs[0].size(), 5u);
  for (size_t j = 0; j < 5; ++j) {
    const TokenLogprobs& entry = out.prompt_logprobs[0][j];
    const TokenLogprobs& sampled = *out.samples[j].logprobs[0];
    EXPECT_EQ(entry.token_id, prompt[j + 2]);
    EXPECT_EQ(entry.top, sampled.top) << "position " << j + 1;
    EXPECT_GE(entry.rank, 1);
    EXPECT_LE(entry.logprob, sampled.top[0].second);
    if (entry.rank == 1) EXPECT_FLOAT_EQ(entry.logprob, sampled.top[0].second);
  }
  // Outside the step's tokens: refused before the forward.
  EXPECT_THROW(h.runner.execute(work, {}, {{0, 3, {1, 2, 3, 4, 5}, 0}}), std::out_of_range);
  EXPECT_THROW(h.runner.execute(work, {}, {{0, 0, {}, 0}}), std::out_of_range);
}

TEST(ModelRunner, LogitsSlicesKeepTheSampledRowsWholeAndBoundThePromptRows) {
  using Slices = std::vector<std::pair<int64_t, int64_t>>;
  EXPECT_EQ(logits_slices(0, 0), Slices{});
  EXPECT_EQ(logits_slices(5, 5), (Slices{{0, 5}}));
  const int64_t n = kPromptLogitsRowsPerSlice;
  EXPECT_EQ(logits_slices(3, 3 + 2 * n + 1), (Slices{{0, 3}, {3, n}, {3 + n, n}, {3 + 2 * n, 1}}));
  EXPECT_EQ(logits_slices(0, n), (Slices{{0, n}}));
}

TEST(ModelRunner, NaNLogitsGiveMinusOneNotACrash) {
  auto weights = tiny_weights(tiny_config());
  weights["lm_head.weight"].fill_(std::numeric_limits<float>::quiet_NaN());
  SamplingParams sampled;
  sampled.top_p = 0.5;
  sampled.top_k = 3;
  const SamplingParams params = greedy();
  RequestRandom random(0);
  Harness h(create_causal_lm(tiny_config(), weights, 32));
  h.scheduler.add(0, {1, 2, 3});
  const SchedulerOutput work = h.scheduler.schedule();
  const std::vector<SamplingTarget> targets = {{0, 2, SamplingRow{&params, &random}},
                                               {0, 2, SamplingRow{&sampled, &random}}};
  const auto out = h.runner.execute(work, targets);
  ASSERT_EQ(out.samples.size(), 2u);
  for (const SampledTokens& s : out.samples) EXPECT_EQ(s.token_ids, (std::vector<int64_t>{-1}));
}

TEST(ModelFactory, NamesTheFamilies) {
  ModelConfig c = tiny_config();
  c.architecture = "GPT2LMHeadModel";
  c.family = "gpt2";
  try {
    create_causal_lm(c, tiny_weights(tiny_config()), 32);
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("'gpt2'"), std::string::npos);
    EXPECT_NE(message.find("llama, deepseek_v2"), std::string::npos);
  }
}

TEST(ModelFactory, ReportsAMissingWeight) {
  auto weights = tiny_weights(tiny_config());
  weights.erase("layers.1.mlp.down_proj.weight");
  EXPECT_THROW(create_causal_lm(tiny_config(), weights, 32), std::invalid_argument);
}

}  // namespace
}  // namespace kvserve
