#include "kvserve/sampler.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/log_softmax.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/tensor.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <stdexcept>

namespace kvserve {
namespace {

TEST(SamplingParams, ValidatesEachField) {
  EXPECT_NO_THROW(SamplingParams{}.validate());
  SamplingParams top_k_off;
  top_k_off.top_k = 0;  // off, as -1 (transformers' and vLLM's reading)
  EXPECT_NO_THROW(top_k_off.validate());
  auto invalid = [](auto mutate) {
    SamplingParams p;
    mutate(p);
    EXPECT_THROW(p.validate(), std::invalid_argument);
  };
  invalid([](SamplingParams& p) { p.temperature = -1.0; });
  invalid([](SamplingParams& p) { p.temperature = std::nan(""); });
  invalid([](SamplingParams& p) { p.top_k = -2; });
  invalid([](SamplingParams& p) { p.logit_bias = {{3, 100.5}}; });
  invalid([](SamplingParams& p) { p.logit_bias = {{3, std::nan("")}}; });
  invalid([](SamplingParams& p) { p.logit_bias = {{-1, 1.0}}; });
  invalid([](SamplingParams& p) { p.allowed_token_ids = std::vector<int64_t>{}; });
  invalid([](SamplingParams& p) { p.allowed_token_ids = std::vector<int64_t>{3, -1}; });
  invalid([](SamplingParams& p) { p.top_p = 0.0; });
  invalid([](SamplingParams& p) { p.top_p = 1.01; });
  invalid([](SamplingParams& p) { p.min_p = -0.1; });
  invalid([](SamplingParams& p) { p.max_tokens = 0; });
  invalid([](SamplingParams& p) { p.stop_token_ids = {-2}; });
  invalid([](SamplingParams& p) { p.n = 0; });
  invalid([](SamplingParams& p) { p.repetition_penalty = 0.0; });
  invalid([](SamplingParams& p) { p.presence_penalty = 2.5; });
  invalid([](SamplingParams& p) { p.frequency_penalty = -2.5; });
  invalid([](SamplingParams& p) { p.min_tokens = p.max_tokens + 1; });
  invalid([](SamplingParams& p) { p.min_tokens = -1; });
  invalid([](SamplingParams& p) { p.logprobs = -1; });
  invalid([](SamplingParams& p) { p.stop = {"ok", ""}; });
}

TEST(RequestRandom, SeedFixesTheStreamAndValuesStayInUnitInterval) {
  RequestRandom a(std::optional<uint64_t>(42)), b(std::optional<uint64_t>(42));
  RequestRandom c(std::optional<uint64_t>(43));
  bool differs = false;
  for (int i = 0; i < 1000; ++i) {
    const float x = a.next_uniform();
    EXPECT_EQ(x, b.next_uniform());
    EXPECT_GE(x, 0.0f);
    EXPECT_LT(x, 1.0f);
    differs |= x != c.next_uniform();
  }
  EXPECT_TRUE(differs);
}

TEST(Sampler, GreedyRowsTakeTheArgmaxAndDrawNoRandomNumber) {
  at::Tensor logits = at::randn({3, 50});
  const at::Tensor expected = logits.argmax(1);
  SamplingParams greedy;
  greedy.temperature = 0.0;
  RequestRandom r0(std::optional<uint64_t>(1)), r1(std::optional<uint64_t>(1));
  RequestRandom r2(std::optional<uint64_t>(1));
  at::Tensor tokens = Sampler().sample(logits, {&greedy, &greedy, &greedy}, {&r0, &r1, &r2});
  EXPECT_TRUE(tokens.equal(expected));
  RequestRandom fresh(std::optional<uint64_t>(1));
  EXPECT_EQ(r0.next_uniform(), fresh.next_uniform());  // the stream was not consumed
}

TEST(Sampler, ASeededRowSamplesTheSameTokenInAnyBatch) {
  const at::Tensor row = at::randn({1, 200});
  SamplingParams seeded;
  seeded.temperature = 1.3;
  seeded.top_p = 0.9;
  SamplingParams other;
  other.temperature = 0.7;
  for (int trial = 0; trial < 20; ++trial) {
    RequestRandom alone_random{std::optional<uint64_t>(trial)};
    at::Tensor alone = row.clone();
    const int64_t expected =
        Sampler().sample(alone, {&seeded}, {&alone_random}).item<int64_t>();
    RequestRandom batched_random{std::optional<uint64_t>(trial)};
    RequestRandom noise(std::nullopt);
    at::Tensor batch = at::cat({at::randn({1, 200}), row});
    at::Tensor tokens = Sampler().sample(batch, {&other, &seeded}, {&noise, &batched_random});
    EXPECT_EQ(tokens[1].item<int64_t>(), expected);
  }
}

TEST(Sampler, TopKOfOneIsGreedy) {
  at::Tensor logits = at::randn({4, 30});
  const at::Tensor expected = logits.argmax(1);
  SamplingParams p;
  p.temperature = 5.0;
  p.top_k = 1;
  std::vector<RequestRandom> randoms;
  for (int i = 0; i < 4; ++i) randoms.emplace_back(std::nullopt);
  EXPECT_TRUE(Sampler()
                  .sample(logits, {&p, &p, &p, &p},
                          {&randoms[0], &randoms[1], &randoms[2], &randoms[3]})
                  .equal(expected));
}

TEST(Sampler, PenaltyArithmeticIsExact) {
  // Repetition over prompt and output, then presence and frequency over the output only.
  at::Tensor logits = at::tensor({2.0f, -2.0f, 1.0f, 0.5f, 3.0f}).reshape({1, 5});
  SamplingParams p;
  p.temperature = 0.0;
  p.repetition_penalty = 2.0;
  p.presence_penalty = 0.5;
  p.frequency_penalty = 0.25;
  const std::vector<int64_t> prompt = {0, 1}, output = {2, 2, 1};
  RequestRandom random(std::optional<uint64_t>(0));
  const SamplerOutput out =
      Sampler().sample(logits, {SamplingRow{&p, &random, &prompt, &output, nullptr}});
  // 0: 2 / 2; 1: -2 * 2 - 0.5 - 0.25; 2: 1 / 2 - 0.5 - 2 * 0.25; 3 and 4 untouched.
  const std::vector<float> expected = {1.0f, -4.75f, -0.5f, 0.5f, 3.0f};
  for (int64_t i = 0; i < 5; ++i) EXPECT_EQ(logits[0][i].item<float>(), expected[i]) << i;
  EXPECT_EQ(out.token_ids[0].item<int64_t>(), 4);
  EXPECT_FALSE(out.logprobs[0].has_value());
}

TEST(Sampler, MinTokensMasksEosAndStopIdsUntilReached) {
  SamplingParams p;
  p.temperature = 0.0;
  p.min_tokens = 2;
  p.stop_token_ids = {1};
  const std::vector<int64_t> eos = {3}, prompt = {}, one = {0}, two = {0, 0};
  RequestRandom random(std::optional<uint64_t>(0));
  const at::Tensor base = at::tensor({0.0f, 5.0f, 1.0f, 6.0f});
  const float inf = std::numeric_limits<float>::infinity();

  at::Tensor logits = base.clone().reshape({1, 4});
  SamplerOutput out = Sampler().sample(logits, {SamplingRow{&p, &random, &prompt, &one, &eos}});
  const std::vector<float> masked = {0.0f, -inf, 1.0f, -inf};
  for (int64_t i = 0; i < 4; ++i) EXPECT_EQ(logits[0][i].item<float>(), masked[i]) << i;
  EXPECT_EQ(out.token_ids[0].item<int64_t>(), 2);

  p.ignore_eos = true;  // EOS is no longer masked specially; the stop id still is
  logits = base.clone().reshape({1, 4});
  out = Sampler().sample(logits, {SamplingRow{&p, &random, &prompt, &one, &eos}});
  EXPECT_EQ(out.token_ids[0].item<int64_t>(), 3);
  EXPECT_EQ(logits[0][1].item<float>(), -inf);

  p.ignore_eos = false;
  logits = base.clone().reshape({1, 4});
  out = Sampler().sample(logits, {SamplingRow{&p, &random, &prompt, &two, &eos}});
  EXPECT_TRUE(logits.equal(base.reshape({1, 4})));
  EXPECT_EQ(out.token_ids[0].item<int64_t>(), 3);
}

TEST(Sampler, LogprobsComeFromTheRawLogits) {
  at::Tensor logits = at::tensor({1.0f, 3.0f, 2.0f, 0.0f}).reshape({1, 4});
  const at::Tensor raw = at::log_softmax(logits, 1);
  SamplingParams p;
  p.temperature = 0.0;
  p.repetition_penalty = 10.0;  // moves the greedy choice from token 1 to token 2
  p.logprobs = 2;
  const std::vector<int64_t> prompt = {1}, output = {};
  RequestRandom random(std::optional<uint64_t>(0));
  const SamplerOutput out =
      Sampler().sample(logits, {SamplingRow{&p, &random, &prompt, &output, nullptr}});
  ASSERT_TRUE(out.logprobs[0].has_value());
  const TokenLogprobs& lp = *out.logprobs[0];
  EXPECT_EQ(lp.token_id, 2);
  EXPECT_EQ(lp.rank, 2);
  EXPECT_FLOAT_EQ(lp.logprob, raw[0][2].item<float>());
  ASSERT_EQ(lp.top.size(), 2u);
  EXPECT_EQ(lp.top[0].first, 1);
  EXPECT_EQ(lp.top[1].first, 2);
  EXPECT_FLOAT_EQ(lp.top[0].second, raw[0][1].item<float>());
}

TEST(Sampler, RowsThatNeedHistoryMustHaveIt) {
  at::Tensor logits = at::randn({1, 8});
  SamplingParams p;
  p.frequency_penalty = 0.5;
  RequestRandom random(std::nullopt);
  EXPECT_THROW(Sampler().sample(logits, {SamplingRow{&p, &random}}), c10::Error);
}

}  // namespace
}  // namespace kvserve
