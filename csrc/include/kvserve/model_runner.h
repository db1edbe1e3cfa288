#pragma once
// The middle call of an engine step: flattens what the Scheduler picked into one batch, runs the
// model over it on the paged KV cache, computes logits only at the positions that are sampled,
// and samples them. It never sees requests: sequences, positions and sampling rows only.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "kvserve/causal_lm.h"
#include "kvserve/communicator.h"
#include "kvserve/cuda_graph_runner.h"
#include "kvserve/forward_batch.h"
#include "kvserve/paged_kv_cache.h"
#include "kvserve/sampler.h"
#include "kvserve/scheduler.h"
#include "kvserve/sequence_state.h"
#include "kvserve/speculative_decoder.h"

namespace kvserve {

/// One token to sample: from the logits at `position` of the scheduled sequence
/// `scheduled_index` (into SchedulerOutput::scheduled), with `row`'s parameters, random stream
/// and history. `position` counts within the tokens the step feeds that sequence, from 0 to
/// num_new_tokens - 1 (the last one for a plain decode; speculative verification asks for
/// several). Several targets may share one position (n > 1 samples of one prompt).
struct SamplingTarget {
  int64_t scheduled_index = 0;
  int64_t position = 0;
  SamplingRow row;
};

/// Prompt tokens to score (SamplingParams::prompt_logprobs): the logits at positions `position`,
/// `position` + 1, ... of the scheduled sequence `scheduled_index` (counted as a SamplingTarget's)
/// give token_ids[0], token_ids[1], ... their log-probabilities, ranks and the num_top most
/// likely tokens there.
struct PromptLogprobsTarget {
  int64_t scheduled_index = 0;
  int64_t position = 0;
  std::vector<int64_t> token_ids;
  int64_t num_top = 0;
};

/// The logits of a step's rows are computed in slices: the sampled rows (and verified drafts) in
/// one, then the rows of prompt logprobs at most this many at a time, so that a long prefill's
/// scoring holds [this many, vocab] fp32 values at once, not [its tokens, vocab].
constexpr int64_t kPromptLogitsRowsPerSlice = 256;

/// (first row, rows) of each slice, in order, for `num_sampled_rows` rows to sample followed by
/// prompt rows up to `num_rows`. Every rank of a tensor-parallel model computes the same slices:
/// each gathers the vocabulary's shards across them.
std::vector<std::pair<int64_t, int64_t>> logits_slices(int64_t num_sampled_rows,
                                                       int64_t num_rows);

/// What one SamplingTarget produced.
struct SampledTokens {
  /// One sampled token; with speculation, the accepted drafts and then one token drawn from the
  /// target. The last is -1 where the logits were no distribution (NaN, +inf, or every token
  /// masked): the caller ends that sample with an error.
  std::vector<int64_t> token_ids;
  std::vector<std::optional<TokenLogprobs>> logprobs;  ///< one per token; where the row asks
  int64_t num_draft_tokens = 0;  ///< drafts verified for this target (0: plain sampling)
  int64_t num_accepted = 0;      ///< the leading drafts in token_ids (their KV is written)
};

/// What ModelRunner::execute produced.
struct ModelRunnerOutput {
  std::vector<SampledTokens> samples;  ///< one per SamplingTarget
  /// One per PromptLogprobsTarget: an entry per token it scores.
  std::vector<std::vector<TokenLogprobs>> prompt_logprobs;
  double propose_seconds = 0.0;  ///< in the proposer (0 without speculation)
  double verify_seconds = 0.0;   ///< forward + sampling of a step that verified drafts
  bool cuda_graph = false;       ///< the forward replayed a CUDA graph
};

/// A step launched by ModelRunner::launch whose samples are still on their way to the host.
struct LaunchedStep {
  PendingSamples samples;  ///< one row per SamplingTarget, in their order
  /// One per PromptLogprobsTarget, as ModelRunnerOutput's (scored before launch returns).
  std::vector<std::vector<TokenLogprobs>> prompt_logprobs;
  bool cuda_graph = false;
};

/// How a ModelRunner is made; name the fields: ModelRunner(model, sequences, {.num_blocks = 64}).
struct ModelRunnerOptions {
  int64_t num_blocks = 0;   ///< KV pool blocks of every layer, the null block included
  int64_t block_size = 16;  ///< tokens per block
  /// The block manager's groups of layers, each one's sliding window (0: full attention); they
  /// must be the model's (KVCacheLayout::for_model).
  std::vector<int64_t> group_windows = {0};
  /// Borrowed, outliving the runner: the scheduled sequences that have draft slots get drafts,
  /// and their targets are verified. Null: no speculation.
  SpeculativeDecoder* speculator = nullptr;
  std::optional<at::ScalarType> kv_cache_dtype;  ///< the model's dtype when unset
  /// The state pool of a model with state-space layers: slots (the block manager's) and the SSM
  /// states' dtype (fp32 when unset).
  int64_t num_state_slots = 0;
  std::optional<at::ScalarType> ssm_state_dtype;
  /// > 0, for a model that CudaGraphRunner supports: decode steps of up to that many sequences,
  /// whose contexts fit max_model_len, replay CUDA graphs.
  int64_t cuda_graph_max_batch = 0;
  int64_t max_model_len = 0;
  /// Tensor parallelism: the control group of the model's ranks, this runner being rank 0's.
  /// Each step goes to the workers (TensorParallelWorker) before its forward, and the runner's
  /// destruction stops them; steps run eagerly (no CUDA graphs). Null or one rank: alone.
  std::shared_ptr<Communicator> workers;
};

/// Runs a CausalLM over scheduled steps on a paged KV cache that it owns. What a step feeds the
/// model comes in its SchedulerOutput alone; the SequenceTable (the engine's, outliving the
/// runner) gives proposers the sequences' histories.
class ModelRunner {
 public:
  /// Allocates the KV pool: options.num_blocks blocks of options.block_size tokens for every
  /// layer of `model`. Throws std::invalid_argument when the groups are not the model's.
  ModelRunner(std::shared_ptr<CausalLM> model, const SequenceTable& sequences,
              ModelRunnerOptions options);
  ~ModelRunner();

  /// Copies the step's copy-on-write blocks, asks the speculator for drafts, runs one forward
  /// over every scheduled sequence's new tokens and drafts (writing their K/V), and samples
  /// `targets` (verifying the drafts of a target whose sequence has some: one target per such
  /// sequence), and scores `prompt_targets` (whose sequences must have no drafts). Throws
  /// (c10::Error / std::exception) when the forward fails, std::out_of_range for a target outside
  /// the step's tokens; the cache may then hold partial K/V of the step.
  ModelRunnerOutput execute(const SchedulerOutput& work, const std::vector<SamplingTarget>& targets,
                            const std::vector<PromptLogprobsTarget>& prompt_targets = {});

  /// execute() for asynchronous scheduling: the same step, launched without waiting for its
  /// samples, which ModelRunner::finish reads. `feed` fills the tokens an earlier launched step
  /// sampled (kPendingToken in the scheduled token ids) from its device tensor, which is also
  /// where the targets' rows' pending_source point. One plain sample per target: no
  /// speculation, no other ranks (std::logic_error). `prompt_targets` are scored before it
  /// returns (the host then waits for the forward).
  LaunchedStep launch(const SchedulerOutput& work, const std::vector<SamplingTarget>& targets,
                      const std::vector<PromptLogprobsTarget>& prompt_targets,
                      const TokenFeed& feed);
  /// Waits for a launched step's samples: one SampledTokens per target.
  ModelRunnerOutput finish(LaunchedStep& step);

  CausalLM& model() { return *model_; }
  const CausalLM& model() const { return *model_; }
  const PagedKVCache& kv_cache() const { return kv_cache_; }

 private:
  // The step's block and state copies, after checking that its sequences, targets and prompt
  // targets fit its tokens, and that `feed` (may be null) fills exactly its pending tokens.
  // Returns them with the state snapshots that follow the forward (the workers replay them).
  StepCopies prepare(
      const SchedulerOutput& work, const std::vector<SamplingTarget>& targets,
      const std::vector<PromptLogprobsTarget>& prompt_targets, const TokenFeed* feed);
  // Adds each scheduled sequence's new tokens, then its drafts (`proposals` may be null), to
  // `builder`; clears decode_only unless every sequence feeds one token. Returns each one's first
  // row in the batch, then the batch's rows.
  std::vector<int64_t> add_sequences(const SchedulerOutput& work, const Proposals* proposals,
                                     ForwardBatchBuilder& builder, bool& decode_only);
  // Hidden states of the builder's batch: a CUDA graph's replay where it fits (cuda_graph set),
  // else an eager forward that the workers run too. `feed` (may be null) fills pending tokens.
  at::Tensor run_forward(ForwardBatchBuilder& builder, bool decode_only,
                         const StepCopies& copies,
                         const std::vector<int64_t>& hidden_rows, int64_t num_sampled_rows,
                         const TokenFeed* feed, bool& cuda_graph);
  // The entries of `prompt_targets` from the logits of the rows of `hidden` that rows_index
  // lists, in slices[first_slice..] (after the num_sampled_rows sampled rows).
  std::vector<std::vector<TokenLogprobs>> score_prompt(
      const at::Tensor& hidden, const at::Tensor& rows_index,
      const std::vector<std::pair<int64_t, int64_t>>& slices, size_t first_slice,
      int64_t num_sampled_rows, const std::vector<PromptLogprobsTarget>& prompt_targets);
  // Samples `targets` from the logits of the step's sampled rows: the plain ones' rows first
  // (logit_row_of_target), then each verified target's drafts + 1.
  void sample_targets(at::Tensor logits, const std::vector<SamplingTarget>& targets,
                      const std::vector<size_t>& plain, const std::vector<size_t>& verified,
                      const std::vector<int64_t>& logit_row_of_target, int64_t num_plain_rows,
                      const Proposals& proposals, const SchedulerOutput& work,
                      ModelRunnerOutput& out);

  std::shared_ptr<CausalLM> model_;
  PagedKVCache kv_cache_;
  const SequenceTable& sequences_;
  SpeculativeDecoder* speculator_;
  Sampler sampler_;
  std::unique_ptr<CudaGraphRunner> graphs_;  // null: eager steps only
  std::shared_ptr<Communicator> workers_;    // null: no other ranks
};

}  // namespace kvserve
