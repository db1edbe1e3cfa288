#pragma once
// Speculative decoding: a cheap proposer guesses up to k tokens per decoding sequence, the target
// model scores all of them in the step's one forward, and modified rejection sampling keeps the
// output distribution exactly the target's (greedy requests: exactly the target's argmax).
//
// Per step, inside ModelRunner::execute: propose() (after the scheduler reserved k draft slots per
// speculating sequence) -> the target forward over the new tokens + drafts -> verify(). The
// engine appends what verify() emitted: the accepted drafts (their KV is already written) and one
// token drawn from the target, so every step emits at least the token plain decoding would.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kvserve/communicator.h"
#include "kvserve/sampler.h"
#include "kvserve/scheduler.h"
#include "kvserve/sequence_state.h"

namespace kvserve {

class CausalLM;

/// How an engine speculates. method "" is off; "draft_model" proposes with a second CausalLM of
/// the same vocabulary; "ngram" with prompt lookup (no model); "mtp" with the target
/// checkpoint's multi-token-prediction modules (an MtpHead in the draft model's place).
struct SpeculativeConfig {
  std::string method;
  int64_t num_speculative_tokens = 0;  ///< k: draft tokens per sequence and step, at most
  int64_t prompt_lookup_min = 1;       ///< ngram: shortest suffix to match
  int64_t prompt_lookup_max = 4;       ///< ngram: longest suffix to match
  /// Speculation pauses while this many sequences or more are running (0: never). Large batches
  /// are compute-bound, where verifying k + 1 positions per sequence costs more than it saves.
  int64_t disable_batch_size = 0;
  /// Per step, k shrinks to max_verify_tokens / running - 1 (0: no limit): the verification
  /// forward then scores at most this many tokens, keeping it in the memory-bound regime where
  /// scoring k + 1 tokens costs about as much as scoring one.
  int64_t max_verify_tokens = 0;

  bool enabled() const { return !method.empty(); }
  /// Throws std::invalid_argument naming the first bad field.
  void validate() const;
};

/// The draft tokens of one step, per scheduled sequence.
struct Proposals {
  std::vector<std::vector<int64_t>> tokens;  ///< per SchedulerOutput::scheduled entry; may be empty
  /// fp32 [total drafts, vocab], the distribution each draft was drawn from (after the request's
  /// history and filters), rows in the order of `tokens`; undefined: every draft is a point mass.
  at::Tensor probs;
  int64_t num_tokens() const;
};

/// What a proposer sees of a step.
struct ProposalContext {
  const SchedulerOutput& work;
  /// The scheduled sequences' whole histories (the step's entries carry only its new tokens).
  const SequenceTable& sequences;
  /// Per scheduled entry: the sampling row of its sequence's next token, or null when the entry
  /// has no draft slots (num_speculative_tokens == 0) or samples nothing.
  const std::vector<const SamplingRow*>& rows;
};

/// Guesses draft tokens. Called every step, in order, also when no sequence has draft slots (a
/// draft model keeps its KV cache in step with the target's).
class Proposer {
 public:
  virtual ~Proposer() = default;
  /// Up to work.scheduled[i].num_speculative_tokens tokens for entry i (fewer, or none, is fine).
  virtual Proposals propose(const ProposalContext& context) = 0;
  /// After the target's forward of the step `work` (called every step, before the engine
  /// appends what was verified): its final-norm hidden states, rows starts[i] to starts[i + 1]
  /// of scheduled entry i (its new tokens, then the drafts it verified; starts has one entry
  /// more). A proposer that drafts from them copies what it keeps (the tensor may be reused).
  virtual void observe(const SchedulerOutput& work, const std::vector<int64_t>& starts,
                       const at::Tensor& hidden) {}
};

/// What a proposer is made from: the options, the target model, the draft model if the method
/// takes one, and the KV pool's shape (a draft model keeps a pool of the target's block ids).
struct ProposerContext {
  const SpeculativeConfig& config;
  const CausalLM& target;
  std::shared_ptr<CausalLM> draft;
  int64_t num_blocks = 0;
  int64_t block_size = 0;
  int64_t max_model_len = 0;
  /// The tensor-parallel control group (null on one rank): a head split over the ranks with the
  /// target runs on every rank.
  std::shared_ptr<Communicator> workers;
};

/// One speculative method: its SpeculativeConfig::method name, whether it drafts with a second
/// model, and how its proposer is made (it may throw std::invalid_argument on a bad pairing).
struct ProposerEntry {
  std::string method;
  bool needs_draft_model = false;
  std::function<std::unique_ptr<Proposer>(const ProposerContext&)> make;
};

/// The methods kvserve speculates with ("ngram", "draft_model"): a new proposer is one entry
/// here (speculative_decoder.cpp) plus its class (docs/contributing/adding-a-proposer.md).
const std::vector<ProposerEntry>& proposer_registry();
/// Their names, in registry order.
std::vector<std::string> speculative_methods();

/// What verify() returns for one speculating sequence.
struct VerifiedTokens {
  /// The accepted drafts, then the token drawn from the target (-1 when the target's logits there
  /// held no distribution: the sample ends with an error).
  std::vector<int64_t> token_ids;
  std::vector<std::optional<TokenLogprobs>> logprobs;  ///< one per token, where the row asks
  int64_t num_accepted = 0;
};

/// Owns the proposer and verifies its drafts by exact rejection sampling.
class SpeculativeDecoder {
 public:
  /// Throws std::invalid_argument on a bad config.
  SpeculativeDecoder(SpeculativeConfig config, std::unique_ptr<Proposer> proposer);

  /// The proposer `config.method` names: for "draft_model", `draft` (required; same vocabulary
  /// as `target`, positions up to max_model_len) with its own KV pool of the target's block ids.
  /// Throws std::invalid_argument.
  static std::unique_ptr<SpeculativeDecoder> create(const SpeculativeConfig& config,
                                                    const CausalLM& target,
                                                    std::shared_ptr<CausalLM> draft,
                                                    int64_t num_blocks, int64_t block_size,
                                                    int64_t max_model_len,
                                                    std::shared_ptr<Communicator> workers = nullptr);

  /// Draft slots per sequence for a step that starts with `num_running` running sequences: k,
  /// at most max_verify_tokens / num_running - 1, and 0 at and above disable_batch_size.
  int64_t num_speculative_tokens(int64_t num_running) const;

  Proposals propose(const ProposalContext& context) { return proposer_->propose(context); }
  void observe(const SchedulerOutput& work, const std::vector<int64_t>& starts,
               const at::Tensor& hidden) {
    proposer_->observe(work, starts, hidden);
  }

  /// Rejection sampling for B sequences. logits: fp32 [sum (k_b + 1), vocab], the target's raw
  /// logits at each sequence's last new token and its k_b drafts (modified in place). rows[b] is
  /// the sequence's sampling row; drafts[b] its k_b >= 0 drafts; draft_probs the rows of
  /// Proposals::probs for these drafts in order (undefined: point masses). Non-greedy rows draw
  /// k_b + 1 uniform numbers from their random stream; greedy rows draw none.
  std::vector<VerifiedTokens> verify(at::Tensor& logits, const std::vector<SamplingRow>& rows,
                                     const std::vector<std::vector<int64_t>>& drafts,
                                     const at::Tensor& draft_probs) const;

  const SpeculativeConfig& config() const { return config_; }

 private:
  SpeculativeConfig config_;
  std::unique_ptr<Proposer> proposer_;
  Sampler sampler_;
};

/// A sampling row whose history continues with `drafts`: the row at a position after them sees
/// them as generated tokens (penalties, min_tokens). `storage` keeps the extended history alive.
SamplingRow row_after_drafts(const SamplingRow& row, const std::vector<int64_t>& drafts,
                             size_t num_drafts, std::vector<int64_t>& storage);

}  // namespace kvserve
