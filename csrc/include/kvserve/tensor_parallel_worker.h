#pragma once
// Tensor parallelism's one scheduler (as in vLLM and SGLang): rank 0 runs the whole engine
// (scheduler, block manager, prefix cache, sampler) over its shard of the model, and each step
// sends the other ranks what the forward needs: the copy-on-write block pairs and the packed
// ForwardBatch, over the control group (Gloo, on the host: a few KiB a step). A worker rank
// holds its shard and a KV pool of the same blocks, and runs the forward and its share of the
// logits, nothing else; the shards meet in the model's collectives (the device group). ModelRunner
// sends (its options' `workers`); TensorParallelWorker receives. A speculative head split over
// the ranks as its target is (MTP modules) runs the same way: HeadProposer sends each of its
// forwards and logit rows, and the workers run them on their shards and a head pool of their own.

#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "kvserve/causal_lm.h"
#include "kvserve/communicator.h"
#include "kvserve/forward_batch.h"
#include "kvserve/paged_kv_cache.h"

namespace kvserve {

class DraftHead;

/// What rank 0 tells the workers: run a step, stop, load a LoRA adapter's factors, run a depth of
/// a split speculative head, compute the head's logits of some rows.
enum class WorkerCommand : int64_t {
  kStep = 1,
  kStop = 2,
  kSetLora = 3,
  kDraft = 4,
  kDraftLogits = 5
};

/// Rank 0: broadcasts `command` and `payload` over `control` (a header of two values, then the
/// payload). Blocks until every rank has it; throws (c10::Error) when a rank is gone.
void send_to_workers(Communicator& control, WorkerCommand command,
                     const std::vector<int64_t>& payload = {});

/// A worker: the next command and payload from rank 0.
std::pair<WorkerCommand, std::vector<int64_t>> receive_from_rank0(Communicator& control);

/// A step's message: its block and state copies (before the forward) and state snapshots
/// (after it), the rows of the forward's output whose logits
/// rank 0 computes (every rank computes its vocabulary's share of them, in the slices of
/// logits_slices: the first num_sampled_rows are sampled, the rest score prompts), the rows and
/// sources of `feed` (may be null) and the length of its tokens, then the batch
/// (ForwardBatchBuilder::pack). A feed's tokens (asynchronous scheduling: sampled by the step
/// before, on rank 0's device only) follow the message over the model's device group
/// (send_fed_tokens), so that no rank waits on the host for them.
std::vector<int64_t> pack_step(const StepCopies& copies,
                               const std::vector<int64_t>& logit_rows, int64_t num_sampled_rows,
                               const ForwardBatchBuilder& batch, const TokenFeed* feed = nullptr);

/// Rank 0: a step's fed tokens to the workers over `ranks` (the model's device group), after
/// the step's message; nothing when the feed has no rows.
void send_fed_tokens(Communicator& ranks, const TokenFeed& feed);

/// Rank 0, a speculative head split over `ranks` (its device group): the forward of depth
/// `depth` over `batch` for the workers to run beside rank 0's, with the head pool's block copies
/// due before it (over `control`), then its `previous` rows (over `ranks`: they are
/// DraftHead::forward_depth's, already whole on every rank but known only to rank 0's proposer).
void send_draft_depth(Communicator& control, Communicator& ranks, int64_t depth,
                      const std::vector<std::pair<int32_t, int32_t>>& copies,
                      const at::Tensor& previous, const ForwardBatchBuilder& batch);

/// Rank 0: the head's output rows whose logits it computes next (DraftHead::compute_logits),
/// for the workers to compute their vocabulary's share of them.
void send_draft_logits(Communicator& control, Communicator& ranks, const at::Tensor& hidden);

/// A LoRA message: the slot, then worker_factors[i], rank i + 1's shard of the adapter (each
/// target's name, the shapes of a and b, their values in fp32, two to a value of the message).
std::vector<int64_t> pack_lora(int64_t slot, const std::vector<LoraFactors>& worker_factors);

/// The slot and rank `rank`'s factors (CPU, fp32) of a pack_lora message; throws
/// std::runtime_error for a malformed one.
std::pair<int64_t, LoraFactors> unpack_lora(const std::vector<int64_t>& message, int64_t rank);

/// How a worker's pool is made: the same as rank 0's ModelRunner.
struct TensorParallelWorkerOptions {
  int64_t num_blocks = 0;   ///< KV pool blocks, the null block included: rank 0's
  int64_t block_size = 16;  ///< tokens per block
  std::optional<at::ScalarType> kv_cache_dtype;  ///< the model's dtype when unset
  /// A model with state-space layers: rank 0's state pool slots (running sequences and saved
  /// states), and the SSM states' dtype (fp32 when unset).
  int64_t num_state_slots = 0;
  std::optional<at::ScalarType> ssm_state_dtype;
};

/// A rank > 0 of a tensor-parallel model: its shard and its KV pool (grouped by sliding window
/// as rank 0's block manager groups layers).
class TensorParallelWorker {
 public:
  /// Throws std::invalid_argument when `control` is not a group of several ranks with this one
  /// other than rank 0. head: this rank's shard of a speculative head split over the ranks (over
  /// `model`), which gets a pool of options.num_blocks blocks as rank 0's HeadProposer has.
  TensorParallelWorker(std::shared_ptr<CausalLM> model, std::shared_ptr<Communicator> control,
                       TensorParallelWorkerOptions options,
                       std::shared_ptr<DraftHead> head = nullptr);

  /// Runs rank 0's steps (and loads the LoRA factors it sends) until it stops the workers;
  /// returns how many steps ran. A forward that throws is skipped (rank 0's, run on the same
  /// inputs, throws at the same point and fails the step there), as are factors the model
  /// refuses (rank 0 checked them against its own); a control group that fails (rank 0 gone, its
  /// timeout) throws.
  int64_t serve();

  const PagedKVCache& kv_cache() const { return kv_cache_; }

 private:
  /// A kDraft or kDraftLogits message: the head's forward or logits, as rank 0 runs them.
  void run_draft(WorkerCommand command, const std::vector<int64_t>& message);

  std::shared_ptr<CausalLM> model_;
  std::shared_ptr<Communicator> control_;
  PagedKVCache kv_cache_;
  std::shared_ptr<DraftHead> head_;
  std::unique_ptr<PagedKVCache> head_cache_;  ///< with head_
};

}  // namespace kvserve
