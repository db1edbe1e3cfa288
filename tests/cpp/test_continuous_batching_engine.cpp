// ContinuousBatchingEngine over a tiny random Llama: the three-call step, the stall watchdog,
// metrics ordering, and producers on other threads.
#include "kvserve/continuous_batching_engine.h"

#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "models/model_factory.h"
#include "tiny_model.h"

namespace kvserve {
namespace {

EngineConfig small_pool() {
  EngineConfig c;
  c.max_num_seqs = 8;
  c.max_num_batched_tokens = 16;
  c.max_model_len = 32;
  c.block_size = 4;
  c.num_blocks = 24;
  return c;
}

std::unique_ptr<ContinuousBatchingEngine> make_engine(EngineConfig config = small_pool()) {
  return std::make_unique<ContinuousBatchingEngine>(
      create_causal_lm(tiny_config(), tiny_weights(tiny_config()), 32), std::move(config));
}

// Steps until nothing is unfinished; final outputs by request id.
std::unordered_map<std::string, RequestOutput> drain(ContinuousBatchingEngine& engine) {
  std::unordered_map<std::string, RequestOutput> final;
  for (int step = 0; step < 1000 && engine.has_unfinished_requests(); ++step) {
    for (RequestOutput& out : engine.step()) {
      if (out.finished) final[out.request_id] = std::move(out);
    }
  }
  EXPECT_FALSE(engine.has_unfinished_requests());
  return final;
}

TEST(ContinuousBatchingEngine, RequestsThatCanNeverBeScheduledEndWithAnError) {
  auto engine = make_engine();
  // Simulate a leak: a phantom sequence holds every block, so nothing can ever be admitted.
  auto& blocks = const_cast<PagedBlockManager&>(engine->block_manager());
  blocks.allocate(1 << 20, std::vector<int32_t>(4 * blocks.num_usable_blocks(), 1));
  engine->add_request("stuck", {1, 2, 3}, greedy(4));
  auto final = drain(*engine);
  ASSERT_EQ(final.count("stuck"), 1u);
  EXPECT_EQ(final["stuck"].outputs.at(0).finish_reason, "error");
  EXPECT_NE(final["stuck"].error.find("could not be scheduled"), std::string::npos);
  EXPECT_EQ(engine->get_stats().num_failed_requests, 1);

  blocks.free(1 << 20);  // the leak fixed, the engine serves again
  engine->add_request("fine", {1, 2, 3}, greedy(4));
  EXPECT_EQ(drain(*engine)["fine"].outputs.at(0).token_ids.size(), 4u);
}

TEST(ContinuousBatchingEngine, MetricsAreOrderedForEveryRequest) {
  auto engine = make_engine();
  for (int i = 0; i < 6; ++i) {
    engine->add_request(std::to_string(i), {1, 2, 3, i + 4}, greedy(2 + i));
  }
  engine->step();
  engine->abort_request("5");
  for (auto& [id, out] : drain(*engine)) {
    const RequestMetrics& m = out.metrics;
    // The times that happened (0: never, e.g. aborted while waiting) are in order.
    double previous = 0.0;
    for (double t : {m.arrival_time, m.first_scheduled_time, m.first_token_time,
                     m.last_token_time, m.finished_time}) {
      if (t == 0.0) continue;
      EXPECT_LE(previous, t) << id;
      previous = t;
    }
    EXPECT_GT(m.arrival_time, 0.0) << id;
    EXPECT_GT(m.e2e_latency(), 0.0) << id;
    if (id != "5") EXPECT_GT(m.first_token_time, 0.0) << id;
  }
  const EngineStats stats = engine->get_stats();
  EXPECT_EQ(stats.num_finished_requests, 6);
  EXPECT_EQ(stats.num_aborted_requests, 1);
  EXPECT_EQ(stats.e2e_latency.count, 6);
}

TEST(ContinuousBatchingEngine, AnAbortBetweenTheStepAndItsFinishIsReportedOnce) {
  // Another thread's abort lands after step() returned, while its caller matches stop strings
  // (the hang of a disconnect during post-processing): finishing it is a no-op that returns
  // its metrics, its id stays in use until the next step reports the abort, and only then is
  // it free again.
  auto engine = make_engine();
  engine->add_request("a", {1, 2, 3}, greedy(8));
  engine->step();
  EXPECT_TRUE(engine->abort_request("a"));
  EXPECT_FALSE(engine->abort_request("a"));  // already ended: one abort
  const RequestMetrics m = engine->finish_completion("a", 0, "stop");
  EXPECT_GT(m.finished_time, 0.0);
  EXPECT_THROW(engine->add_request("a", {1, 2}, greedy(2)), std::invalid_argument);
  EXPECT_TRUE(engine->has_unfinished_requests());
  auto outs = engine->step();
  ASSERT_EQ(outs.size(), 1u);
  EXPECT_EQ(outs[0].outputs.at(0).finish_reason, "abort");
  EXPECT_EQ(outs[0].outputs.at(0).token_ids.size(), 1u);  // the whole list, at the end
  EXPECT_FALSE(engine->has_unfinished_requests());
  EXPECT_THROW(engine->finish_completion("a", 0, "stop"), std::out_of_range);
  engine->add_request("a", {1, 2}, greedy(2));
  EXPECT_EQ(drain(*engine)["a"].outputs.at(0).finish_reason, "length");
}

TEST(ContinuousBatchingEngine, AFailedStepEndsItsRequestsWithAnError) {
  auto engine = make_engine();
  engine->add_request("a", {1, 2, 3}, greedy(4));
  engine->add_request("b", {1, 2}, greedy(4));
  engine->inject_step_failures(1);
  EXPECT_THROW(engine->step(), std::runtime_error);
  auto final = drain(*engine);
  for (const char* id : {"a", "b"}) {
    EXPECT_EQ(final[id].outputs.at(0).finish_reason, "error") << id;
    EXPECT_NE(final[id].error.find("injected step failure"), std::string::npos) << id;
  }
  EXPECT_EQ(engine->get_stats().num_failed_requests, 2);
  EXPECT_EQ(engine->block_manager().num_free_blocks(),
            engine->block_manager().num_usable_blocks());
  engine->add_request("c", {1, 2}, greedy(3));
  EXPECT_EQ(drain(*engine)["c"].outputs.at(0).token_ids.size(), 3u);
}

TEST(ContinuousBatchingEngine, RunningOutputsCarryOnlyTheNewTokens) {
  auto engine = make_engine();
  engine->add_request("a", {1, 2, 3}, greedy(4));
  std::vector<int64_t> seen;
  while (engine->has_unfinished_requests()) {
    for (const RequestOutput& out : engine->step()) {
      const CompletionOutput& c = out.outputs.at(0);
      seen.insert(seen.end(), c.new_token_ids.begin(), c.new_token_ids.end());
      EXPECT_EQ(c.token_ids, c.finished() ? seen : std::vector<int64_t>{});
    }
  }
  EXPECT_EQ(seen.size(), 4u);
}

TEST(ContinuousBatchingEngine, TheWaitingQueueIsBounded) {
  EngineConfig config = small_pool();
  config.max_waiting_requests = 2;
  config.max_num_seqs = 1;
  auto engine = make_engine(config);
  engine->add_request("a", {1, 2}, greedy(4));
  engine->add_request("b", {1, 2}, greedy(4));
  EXPECT_THROW(engine->add_request("c", {1, 2}, greedy(4)), EngineOverloaded);
  engine->step();  // "a" runs: one waits
  engine->add_request("c", {1, 2}, greedy(4));
  EXPECT_EQ(drain(*engine).size(), 3u);
}

TEST(ContinuousBatchingEngine, StopStringsAreBounded) {
  EngineConfig config = small_pool();
  config.max_stop_strings = 2;
  config.max_stop_string_length = 3;
  auto engine = make_engine(config);
  SamplingParams p = greedy(2);
  p.stop = {"a", "b", "c"};
  EXPECT_THROW(engine->add_request("x", {1, 2}, p), std::invalid_argument);
  p.stop = {"abcd"};
  EXPECT_THROW(engine->add_request("x", {1, 2}, p), std::invalid_argument);
  p.stop = {"\xc3\xa9\xc3\xa9\xc3\xa9"};  // three characters in six bytes
  engine->add_request("x", {1, 2}, p);
  p.stop = {};
  p.stop_token_ids = {1 << 20};
  EXPECT_THROW(engine->add_request("y", {1, 2}, p), std::invalid_argument);
  EXPECT_EQ(drain(*engine).size(), 1u);
}

TEST(ContinuousBatchingEngine, ProducersOnOtherThreadsWhileOneThreadSteps) {
  auto engine = make_engine();
  constexpr int kProducers = 16, kEach = 8;
  std::atomic<int> added{0};
  std::atomic<bool> done{false};
  std::unordered_map<std::string, RequestOutput> final;
  std::thread owner([&] {
    while (!done || engine->has_unfinished_requests()) {
      for (RequestOutput& out : engine->step()) {
        if (out.finished) final[out.request_id] = std::move(out);
      }
      (void)engine->get_stats();
    }
  });
  std::vector<std::thread> producers;
  for (int p = 0; p < kProducers; ++p) {
    producers.emplace_back([&, p] {
      for (int i = 0; i < kEach; ++i) {
        const std::string id = std::to_string(p) + "-" + std::to_string(i);
        engine->add_request(id, {1, p + 3, i + 3}, greedy(1 + (p + i) % 5));
        ++added;
        if ((p + i) % 4 == 0) engine->abort_request(id);
      }
    });
  }
  for (auto& t : producers) t.join();
  done = true;
  owner.join();
  EXPECT_EQ(added.load(), kProducers * kEach);
  EXPECT_EQ(static_cast<int>(final.size()), kProducers * kEach);
  EXPECT_EQ(engine->get_stats().num_finished_requests, kProducers * kEach);
  EXPECT_EQ(engine->block_manager().num_sequences(), 0);
  EXPECT_EQ(engine->block_manager().num_free_blocks(), engine->block_manager().num_usable_blocks());
}

}  // namespace
}  // namespace kvserve
