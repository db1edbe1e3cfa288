#pragma once
// Turns the last-position logits of a batch into next tokens, each row with its own parameters
// and its own random stream, so a seeded request samples the same tokens in any batch.
//
// Per row, in order: logprobs from the raw logits (rows that ask) -> min_tokens mask ->
// repetition penalty -> presence/frequency penalties -> temperature, top-k, top-p, min-p ->
// greedy argmax (temperature 0) or one draw from the row's random stream.

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "kvserve/request_random.h"
#include "kvserve/sampling_params.h"

namespace kvserve {

/// One row of a batch to sample: its parameters, random stream and token history. The pointers
/// are borrowed for the call. prompt/output may be null only when the params need no history
/// (no penalty, min_tokens 0); a null eos_token_ids means the model has no EOS.
struct SamplingRow {
  const SamplingParams* params = nullptr;
  RequestRandom* random = nullptr;
  const std::vector<int64_t>* prompt_token_ids = nullptr;
  const std::vector<int64_t>* output_token_ids = nullptr;  ///< generated so far
  const std::vector<int64_t>* eos_token_ids = nullptr;
  /// >= 0: one more output token follows output_token_ids, still on the device: entry
  /// `pending_source` of begin_sample's pending_tokens (asynchronous scheduling). Penalties,
  /// min_tokens and bad words count it, on the device.
  int64_t pending_source = -1;
};

/// Log-probabilities of one sampled token, from log_softmax of the raw fp32 logits.
struct TokenLogprobs {
  int64_t token_id = 0;  ///< the sampled token
  float logprob = 0.0f;  ///< its log-probability
  int64_t rank = 0;      ///< 1-based: tokens whose logprob is >= the sampled one's (vLLM)
  std::vector<std::pair<int64_t, float>> top;  ///< min(N, vocab) most likely (id, logprob), descending
};

/// What one Sampler::sample call returns.
struct SamplerOutput {
  at::Tensor token_ids;  ///< int64 [rows] on the CPU
  std::vector<std::optional<TokenLogprobs>> logprobs;  ///< one per row; set where params.logprobs is
  /// With want_probs: fp32 [rows, vocab] on the logits' device, the distribution each token was
  /// drawn from (after history and filters); one-hot for greedy rows; zeros where token is -1.
  at::Tensor probs;
};

/// Log-probabilities of the raw logits of the rows that ask for them, taken before the sampler
/// changes the logits and completed once the tokens are known.
struct PendingLogprobs {
  std::vector<int64_t> rows;       ///< batch rows that asked, ascending
  std::vector<int64_t> num_top;    ///< per row that asked: its top entries (params.logprobs)
  at::Tensor logprobs;             ///< fp32 [rows.size(), vocab]
  at::Tensor top_values, top_ids;  ///< [rows.size(), max N]
};

/// A draw whose tokens and logprobs are still on the logits' device, being copied to the host
/// (asynchronous scheduling: the next step is launched before they are read). Holds no pointer
/// into the rows it was drawn for.
struct PendingSamples {
  at::Tensor token_ids;  ///< int64 [rows] on the logits' device: what a next step can feed on
  int64_t num_rows = 0;
  std::vector<int64_t> logprob_rows, num_top;  ///< rows that asked for logprobs, their N
  /// The host copies (pinned off the CPU) of the tokens, the sampled tokens' logprobs and ranks
  /// and the top entries; complete once `copied` is reached.
  at::Tensor host_ids, host_logprob, host_rank, host_top_values, host_top_ids;
  std::optional<c10::Event> copied;  ///< off the CPU
};

/// Sampler for a batch of rows.
class Sampler {
 public:
  /// logits: fp32 [rows, vocab] (modified in place by the masks, penalties and filters); one
  /// SamplingRow per row. Greedy rows draw no random number; other rows draw exactly one.
  /// Throws c10::Error when the row count differs, a row lacks a history its params need, or a
  /// history token id is outside [0, vocab).
  SamplerOutput sample(at::Tensor& logits, const std::vector<SamplingRow>& rows,
                       bool want_probs = false) const;

  /// The distributions sample() would draw from, drawing nothing: fp32 [rows, vocab] on the
  /// logits' device (modified in place as by sample()); one-hot at the argmax for greedy rows;
  /// zeros for rows that are no distribution. Speculative verification compares these.
  at::Tensor probabilities(at::Tensor& logits, const std::vector<SamplingRow>& rows) const;

  /// Logprobs of the raw logits for the rows whose params ask (call before anything changes the
  /// logits), then their entries once the tokens are known (int64 [rows]; -1: no entry). The
  /// rows need params only (no random stream); the tokens may be any (a prompt's, scored).
  PendingLogprobs begin_logprobs(const at::Tensor& logits,
                                 const std::vector<SamplingRow>& rows) const;
  std::vector<std::optional<TokenLogprobs>> finish_logprobs(
      PendingLogprobs& pending, const at::Tensor& tokens,
      const std::vector<SamplingRow>& rows) const;

  /// sample() in two halves. The first draws (every host-side part of sampling: the random
  /// draws, the parameters' upload) and starts copying the results to the host without waiting
  /// for them; the second waits for the copies and returns what sample() returns (no probs).
  /// Between the two the caller may launch more work on the device, and the rows' params and
  /// histories may go away.
  /// pending_tokens: int64 on the logits' device, the tokens rows' pending_source index.
  PendingSamples begin_sample(at::Tensor& logits, const std::vector<SamplingRow>& rows,
                              const at::Tensor& pending_tokens = {}) const;
  SamplerOutput finish_sample(PendingSamples& pending) const;

  /// The history-free form: temperature, top-k, top-p and min-p only (penalties, min_tokens and
  /// logprobs are not applied). Returns int64 [rows] on the CPU.
  at::Tensor sample(at::Tensor& logits, const std::vector<const SamplingParams*>& params,
                    const std::vector<RequestRandom*>& randoms) const;
};

}  // namespace kvserve
