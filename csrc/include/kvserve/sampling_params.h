#pragma once
// How one request turns logits into tokens and when it stops. Bound to Python as
// kvserve.SamplingParams (same names). Penalties and logprobs follow vLLM (v1) and the OpenAI API.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace kvserve {

/// Sampling and stopping parameters of one request; temperature 0 means greedy.
struct SamplingParams {
  static constexpr int64_t kMaxN = 1024;
  static constexpr int64_t kMaxTopK = (int64_t{1} << 31) - 1;
  /// Temperatures below this sample greedily (dividing by them would overflow fp32), as in vLLM.
  static constexpr double kGreedyTemperature = 1e-5;
  /// A logit_bias value's bound either way (OpenAI's).
  static constexpr double kMaxLogitBias = 100.0;
  /// bad_words: words at most, and bytes and tokens of one at most.
  static constexpr int64_t kMaxBadWords = 128;
  static constexpr int64_t kMaxBadWordBytes = 1024;
  static constexpr int64_t kMaxBadWordTokens = 256;

  int64_t n = 1;  ///< samples per prompt (the engine forks the sequence); in [1, kMaxN]
  double temperature = 1.0;  ///< finite, >= 0; below kGreedyTemperature: greedy
  /// -1 or 0: off (0 as in transformers and vLLM); in [1, kMaxTopK], values >= the vocabulary
  /// keep every token.
  int64_t top_k = -1;
  double top_p = 1.0;   ///< in (0, 1]; 1: off
  double min_p = 0.0;   ///< in [0, 1]; 0: off
  /// > 0; 1: off. Every token id in the prompt or the output so far: a positive logit is divided
  /// by it, a negative one multiplied (Hugging Face / vLLM).
  double repetition_penalty = 1.0;
  /// In [-2, 2]; 0: off. Over output tokens only: logit -= presence * (count > 0) + frequency * count.
  double presence_penalty = 0.0;
  double frequency_penalty = 0.0;
  std::optional<uint64_t> seed;  ///< fixes this request's random stream, whatever else is batched
  int64_t max_tokens = 16;
  /// In [0, max_tokens]: EOS (unless ignore_eos) and stop_token_ids are masked to -inf until this
  /// many tokens were generated.
  int64_t min_tokens = 0;
  bool ignore_eos = false;
  std::vector<int64_t> stop_token_ids;
  /// Strings that end the output when they appear in the detokenized text (matched in Python).
  std::vector<std::string> stop;
  bool include_stop_str_in_output = false;
  /// Unset: no logprobs. N >= 0: the sampled token's log-probability and the N most likely ones,
  /// from the raw logits (before penalties, temperature and filters). The engine bounds N by its
  /// max_logprobs.
  std::optional<int64_t> logprobs;
  /// Unset: none. N >= 0: every prompt token after the first gets its log-probability under the
  /// tokens before it, its rank and the N most likely tokens there (vLLM's prompt_logprobs; an
  /// OpenAI completion's echo). Such a request reads no cached prefix: it computes its whole
  /// prompt. The engine bounds N by its max_logprobs.
  std::optional<int64_t> prompt_logprobs;
  /// Token id -> a value in [-100, 100] added to its logit after the min_tokens mask and before
  /// the penalties, for every token sampled (OpenAI's logit_bias; logprobs stay those of the raw
  /// logits, as vLLM's). The engine checks the ids against the vocabulary.
  std::map<int64_t, double> logit_bias;
  /// Set: only these token ids can be sampled, every other logit masked to -inf first (vLLM's
  /// allowed_token_ids); not empty. The engine checks them against the vocabulary.
  std::optional<std::vector<int64_t>> allowed_token_ids;
  /// Words the output never contains as tokens (vLLM's bad_words): a word's last token is masked
  /// to -inf wherever the output so far ends with its other tokens (a one-token word: always).
  /// Tokenized by the Python engine into bad_words_token_ids (each word alone and after a space);
  /// the prompt is not looked at, as in vLLM.
  std::vector<std::string> bad_words;
  /// The token sequences the sampler bans (see bad_words): filled from bad_words by
  /// LLMEngine.add_request, or set directly by a C++ caller. The engine checks the ids against
  /// the vocabulary.
  std::vector<std::vector<int64_t>> bad_words_token_ids;
  /// Set: only the prompt's last N tokens are kept (-1: the last max_model_len; vLLM's
  /// truncate_prompt_tokens). Applied by the Python engine when it tokenizes the prompt.
  std::optional<int64_t> truncate_prompt_tokens;

  /// Throws std::invalid_argument (Python ValueError) naming the first invalid field. Limits that
  /// depend on the model (max_tokens vs max_model_len, logprobs vs vocabulary) are the engine's.
  void validate() const;

  /// True when the penalties, min_tokens or bad words need the request's token history.
  bool needs_token_history() const;
  /// True when the logits change before temperature and the filters: allowed_token_ids, bad
  /// words, penalties, min_tokens or logit_bias (a greedy draw then is not the raw logits'
  /// argmax).
  bool changes_logits() const;
};

}  // namespace kvserve
