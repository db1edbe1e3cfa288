// SamplingParams: its checks. (Its repr is Python's: python/kvserve/sampling_params.py.)
#include "kvserve/sampling_params.h"

#include <cmath>
#include <stdexcept>
#include <string>

namespace kvserve {
namespace {

void require(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument("SamplingParams: " + message);
}

}  // namespace

void SamplingParams::validate() const {
  require(n >= 1 && n <= kMaxN,
          "n must be in [1, " + std::to_string(kMaxN) + "], got " + std::to_string(n));
  require(std::isfinite(temperature) && temperature >= 0.0,
          "temperature must be a finite number >= 0, got " + std::to_string(temperature));
  require(top_k >= -1 && top_k <= kMaxTopK,
          "top_k must be -1 or 0 (off) or in [1, " + std::to_string(kMaxTopK) + "], got " +
              std::to_string(top_k));
  require(top_p > 0.0 && top_p <= 1.0, "top_p must be in (0, 1], got " + std::to_string(top_p));
  require(min_p >= 0.0 && min_p <= 1.0, "min_p must be in [0, 1], got " + std::to_string(min_p));
  require(std::isfinite(repetition_penalty) && repetition_penalty > 0.0,
          "repetition_penalty must be a finite number > 0, got " +
              std::to_string(repetition_penalty));
  require(presence_penalty >= -2.0 && presence_penalty <= 2.0,
          "presence_penalty must be in [-2, 2], got " + std::to_string(presence_penalty));
  require(frequency_penalty >= -2.0 && frequency_penalty <= 2.0,
          "frequency_penalty must be in [-2, 2], got " + std::to_string(frequency_penalty));
  require(max_tokens >= 1, "max_tokens must be >= 1, got " + std::to_string(max_tokens));
  require(min_tokens >= 0 && min_tokens <= max_tokens,
          "min_tokens must be in [0, max_tokens=" + std::to_string(max_tokens) + "], got " +
              std::to_string(min_tokens));
  for (int64_t id : stop_token_ids) {
    require(id >= 0, "stop_token_ids must be non-negative, got " + std::to_string(id));
  }
  for (const std::string& s : stop) require(!s.empty(), "stop strings must be non-empty");
  require(!logprobs || *logprobs >= 0,
          "logprobs must be None or >= 0, got " + std::to_string(logprobs.value_or(0)));
  require(!prompt_logprobs || *prompt_logprobs >= 0,
          "prompt_logprobs must be None or >= 0, got " +
              std::to_string(prompt_logprobs.value_or(0)));
  require(!truncate_prompt_tokens || *truncate_prompt_tokens == -1 || *truncate_prompt_tokens >= 1,
          "truncate_prompt_tokens must be None, -1 (max_model_len) or >= 1, got " +
              std::to_string(truncate_prompt_tokens.value_or(0)));
  if (allowed_token_ids) {
    require(!allowed_token_ids->empty(), "allowed_token_ids must not be empty (None: every token)");
    for (int64_t id : *allowed_token_ids) {
      require(id >= 0, "allowed_token_ids must be non-negative, got " + std::to_string(id));
    }
  }
  require(static_cast<int64_t>(bad_words.size()) <= kMaxBadWords,
          "at most " + std::to_string(kMaxBadWords) + " bad_words, got " +
              std::to_string(bad_words.size()));
  for (const std::string& word : bad_words) {
    require(word.find_first_not_of(" \t\n\r\f\v") != std::string::npos,
            "bad_words must not be empty or blank");
    require(static_cast<int64_t>(word.size()) <= kMaxBadWordBytes,
            "a bad word may have at most " + std::to_string(kMaxBadWordBytes) +
                " bytes, got one of " + std::to_string(word.size()));
  }
  require(static_cast<int64_t>(bad_words_token_ids.size()) <= 2 * kMaxBadWords,
          "at most " + std::to_string(2 * kMaxBadWords) + " bad_words_token_ids sequences, got " +
              std::to_string(bad_words_token_ids.size()));
  for (const std::vector<int64_t>& word : bad_words_token_ids) {
    require(!word.empty() && static_cast<int64_t>(word.size()) <= kMaxBadWordTokens,
            "a bad_words_token_ids sequence must have 1 to " + std::to_string(kMaxBadWordTokens) +
                " tokens, got " + std::to_string(word.size()));
    for (int64_t id : word) {
      require(id >= 0, "bad_words_token_ids must be non-negative, got " + std::to_string(id));
    }
  }
  for (const auto& [id, bias] : logit_bias) {
    require(id >= 0, "logit_bias token ids must be non-negative, got " + std::to_string(id));
    require(std::isfinite(bias) && std::abs(bias) <= kMaxLogitBias,
            "logit_bias values must be in [-100, 100], got " + std::to_string(bias) +
                " for token " + std::to_string(id));
  }
}

bool SamplingParams::needs_token_history() const {
  return repetition_penalty != 1.0 || presence_penalty != 0.0 || frequency_penalty != 0.0 ||
         min_tokens > 0 || !bad_words_token_ids.empty();
}

bool SamplingParams::changes_logits() const {
  return needs_token_history() || !logit_bias.empty() || allowed_token_ids.has_value();
}

}  // namespace kvserve
