#include "kvserve/sampler.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/randn.h>
#include <gtest/gtest.h>

#include <cmath>
#include <stdexcept>

namespace kvserve {
namespace {

TEST(SamplingParams, ValidatesEachField) {
  EXPECT_NO_THROW(SamplingParams{}.validate());
  auto invalid = [](auto mutate) {
    SamplingParams p;
    mutate(p);
    EXPECT_THROW(p.validate(), std::invalid_argument);
  };
  invalid([](SamplingParams& p) { p.temperature = -1.0; });
  invalid([](SamplingParams& p) { p.temperature = std::nan(""); });
  invalid([](SamplingParams& p) { p.top_k = 0; });
  invalid([](SamplingParams& p) { p.top_p = 0.0; });
  invalid([](SamplingParams& p) { p.top_p = 1.01; });
  invalid([](SamplingParams& p) { p.min_p = -0.1; });
  invalid([](SamplingParams& p) { p.max_tokens = 0; });
  invalid([](SamplingParams& p) { p.stop_token_ids = {-2}; });
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

}  // namespace
}  // namespace kvserve
