#pragma once
// Proposals from a speculative head (models/draft_head.h) that drafts from the target's hidden
// states: a checkpoint's multi-token-prediction (MTP) modules, or an EAGLE-3 head. Depth d's row
// at position p reads the target's state at p (depth 0; the depth before's output after) and the
// token at p + d + 1, and predicts the token at p + d + 2. The rows sit in the head's paged KV at
// position p, with the target's block ids: the row that reads the token at p + 1 is at p rather
// than p + 1 (as in vLLM); rotary attention scores depend only on distances, so the outputs equal
// those of a layout that starts at position 1 (transformers' MtpModel), which has no row at 0.
//
// Each step the proposer keeps what the head reads of the target's forward (observe), and in the
// next step runs the depths over every position whose next tokens are now known (the catch-up:
// every sequence, drafting or not); a sequence that decodes then drafts one token per depth from
// its last row, and more than there are depths by feeding the last depth its own output and
// draft (its rows one position on, rewritten with the true ones a step later).
// A prefix-cache hit skips the target's forward over the positions it covers: the head then
// attends over the rows its blocks hold from the sequence that computed them, whose last row read
// that sequence's next token. Drafts differ then, never the output.
//
// A head split over tensor-parallel ranks with its target (MTP modules: DraftHead::ranks) runs
// on every rank: before each of its forwards and logit computations on rank 0, the proposer sends
// the workers the batch and the rows it reads (send_draft_depth, send_draft_logits), so that the
// ranks meet in the same collectives; only rank 0 samples drafts. A head that is not split (an
// EAGLE-3 head) runs on rank 0 alone.

#include <cstdint>
#include <memory>
#include <unordered_map>

#include "kvserve/communicator.h"
#include "kvserve/paged_kv_cache.h"
#include "kvserve/speculative_decoder.h"

namespace kvserve {

class DraftHead;

class HeadProposer : public Proposer {
 public:
  /// Allocates the head's KV pool: num_blocks blocks of block_size tokens, one layer per depth.
  /// workers: the tensor-parallel control group, which a head split over ranks needs (throws
  /// std::invalid_argument without it).
  HeadProposer(std::shared_ptr<DraftHead> head, int64_t num_blocks, int64_t block_size,
               std::shared_ptr<Communicator> workers = nullptr);

  Proposals propose(const ProposalContext& context) override;
  void observe(const SchedulerOutput& work, const std::vector<int64_t>& starts,
               const at::Tensor& hidden) override;

  const PagedKVCache& kv_cache() const { return kv_cache_; }

 private:
  std::shared_ptr<DraftHead> head_;
  PagedKVCache kv_cache_;
  std::shared_ptr<Communicator> workers_;  ///< set for a split head
  /// The pool's block copies that the workers' pools have yet to make (sent with a forward).
  std::vector<std::pair<int32_t, int32_t>> pending_copies_;
  /// What the proposer holds of one sequence.
  struct Track {
    int64_t num_admissions = 0;  ///< the sequence's SequenceState::num_admissions then
    int64_t first = 0;           ///< the position of hidden's first row
    /// What the head reads of the target (DraftHead::target_states), [rows, width], from
    /// `first` on, that its depths have not read for good yet; undefined: none.
    at::Tensor hidden;
  };
  std::unordered_map<int64_t, Track> tracks_;
};

}  // namespace kvserve
