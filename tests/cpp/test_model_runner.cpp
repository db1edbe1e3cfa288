// ModelRunner and the model factory over a tiny random Llama built in C++.
#include "kvserve/model_runner.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/randn.h>
#include <gtest/gtest.h>

#include <stdexcept>

#include "models/model_factory.h"

namespace kvserve {
namespace {

ModelConfig tiny_config() {
  ModelConfig c;
  c.architecture = "LlamaForCausalLM";
  c.vocab_size = 64;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.max_position_embeddings = 128;
  c.sliding_windows = {0, 0};
  return c;
}

std::unordered_map<std::string, at::Tensor> tiny_weights(const ModelConfig& c) {
  at::manual_seed(0);
  const int64_t h = c.hidden_size, qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim;
  std::unordered_map<std::string, at::Tensor> w{
      {"embed_tokens.weight", at::randn({c.vocab_size, h})},
      {"norm.weight", at::ones({h})},
      {"lm_head.weight", at::randn({c.vocab_size, h}) * 0.3},
  };
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    w[p + "input_layernorm.weight"] = at::ones({h});
    w[p + "post_attention_layernorm.weight"] = at::ones({h});
    w[p + "self_attn.qkv_proj.weight"] = at::randn({qkv, h}) * 0.3;
    w[p + "self_attn.o_proj.weight"] = at::randn({h, c.num_heads * c.head_dim}) * 0.3;
    w[p + "mlp.gate_up_proj.weight"] = at::randn({2 * c.intermediate_size, h}) * 0.3;
    w[p + "mlp.down_proj.weight"] = at::randn({h, c.intermediate_size}) * 0.3;
  }
  return w;
}

GenerationRequest greedy_request(std::vector<int64_t> prompt, int64_t max_tokens) {
  GenerationRequest r;
  r.prompt_token_ids = std::move(prompt);
  r.params.temperature = 0.0;
  r.params.max_tokens = max_tokens;
  r.params.ignore_eos = true;
  return r;
}

class ModelRunnerTest : public ::testing::Test {
 protected:
  ModelRunner runner_{create_causal_lm(tiny_config(), tiny_weights(tiny_config()), 32), 32, 8,
                      {2}};
};

TEST_F(ModelRunnerTest, BatchedGreedyEqualsEachRequestAlone) {
  std::vector<GenerationRequest> batch = {greedy_request({1, 5, 9, 11, 3}, 12),
                                          greedy_request({7}, 20), greedy_request({4, 4, 4}, 3)};
  const auto together = runner_.generate(batch);
  for (size_t i = 0; i < batch.size(); ++i) {
    const auto alone = runner_.generate({batch[i]});
    EXPECT_EQ(together[i].token_ids, alone[0].token_ids) << "request " << i;
    EXPECT_EQ(static_cast<int64_t>(together[i].token_ids.size()), batch[i].params.max_tokens);
    EXPECT_EQ(together[i].finish_reason, "length");
    EXPECT_LE(together[i].start_time, together[i].first_token_time);
    EXPECT_LE(together[i].first_token_time, together[i].finish_time);
  }
}

TEST_F(ModelRunnerTest, StopsAtAStopTokenAndAtMaxModelLen) {
  const auto free = runner_.generate({greedy_request({1, 2, 3}, 10)})[0].token_ids;
  auto stop = greedy_request({1, 2, 3}, 10);
  stop.params.stop_token_ids = {free[4]};
  const auto stopped = runner_.generate({stop})[0];
  EXPECT_EQ(stopped.finish_reason, "stop");
  EXPECT_EQ(stopped.token_ids.back(), free[4]);
  EXPECT_LE(stopped.token_ids.size(), 5u);

  const auto capped = runner_.generate({greedy_request({1, 2, 3}, 100)})[0];
  EXPECT_EQ(capped.token_ids.size(), 32u - 3u);  // prompt + output == max_model_len
  EXPECT_EQ(capped.finish_reason, "length");
}

TEST_F(ModelRunnerTest, RejectsBadRequestsBeforeRunningAny) {
  EXPECT_THROW(runner_.generate({greedy_request({}, 4)}), std::invalid_argument);
  EXPECT_THROW(runner_.generate({greedy_request({1, 64}, 4)}), std::invalid_argument);
  EXPECT_THROW(runner_.generate({greedy_request({1, -1}, 4)}), std::invalid_argument);
  EXPECT_THROW(runner_.generate({greedy_request(std::vector<int64_t>(32, 1), 4)}),
               std::invalid_argument);
  auto bad_params = greedy_request({1}, 4);
  bad_params.params.top_p = 0.0;
  EXPECT_THROW(runner_.generate({greedy_request({1}, 4), bad_params}), std::invalid_argument);
  EXPECT_EQ(runner_.generate({greedy_request({1}, 4)})[0].token_ids.size(), 4u);
}

TEST(ModelFactory, NamesTheSupportedArchitectures) {
  ModelConfig c = tiny_config();
  c.architecture = "GPT2LMHeadModel";
  try {
    create_causal_lm(c, tiny_weights(tiny_config()), 32);
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("GPT2LMHeadModel"), std::string::npos);
    EXPECT_NE(message.find("Qwen3ForCausalLM"), std::string::npos);
  }
}

TEST(ModelFactory, ReportsAMissingWeight) {
  auto weights = tiny_weights(tiny_config());
  weights.erase("layers.1.mlp.down_proj.weight");
  EXPECT_THROW(create_causal_lm(tiny_config(), weights, 32), std::invalid_argument);
}

}  // namespace
}  // namespace kvserve
