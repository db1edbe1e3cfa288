#pragma once
// What the proposers that draft from a model's logits (DraftModelProposer, HeadProposer) share:
// keeping their own KV pool in step with the target's blocks, and sampling drafts one position
// at a time while keeping the distributions each was drawn from for Proposals::probs.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "kvserve/paged_kv_cache.h"
#include "kvserve/sampler.h"
#include "kvserve/speculative_decoder.h"

namespace kvserve::draft_sampling {

/// Applies the step's copy-on-write copies to a proposer's own pool.
void copy_blocks(PagedKVCache& pool, const SchedulerOutput& work);

/// Drops what a proposer holds of sequences that finished, or were preempted and readmitted on
/// other blocks since (per_sequence: seq_id -> a value with num_admissions).
template <typename Map>
void forget_readmitted(Map& per_sequence, const SequenceTable& sequences) {
  for (auto it = per_sequence.begin(); it != per_sequence.end();) {
    const bool same = sequences.contains(it->first) &&
                      sequences.at(it->first).num_admissions == it->second.num_admissions;
    it = same ? std::next(it) : per_sequence.erase(it);
  }
}

/// Samples the drafts of one step into `out`, a draft position at a time.
class DraftRounds {
 public:
  /// drafting: the scheduled entries that draft this step. When every one of them is greedy the
  /// drafts are argmaxes, point masses: no distributions are computed or kept; and when none of
  /// them has penalties, min_tokens, logit_bias or allowed_token_ids either, each position is one
  /// argmax over the logits, with no sampler pass. Drafts never compute logprobs.
  DraftRounds(const ProposalContext& context, Proposals& out,
              const std::vector<size_t>& drafting);

  /// One draft for each of `entries` (indices into work.scheduled) from logits [entries, vocab]
  /// (one row each, modified in place), appended to out.tokens. Per entry: whether it drafted
  /// (false: its row held no distribution, and it should stop).
  std::vector<bool> sample(at::Tensor logits, const std::vector<size_t>& entries);

  /// out.probs: the distributions, in the order of out.tokens (left undefined when greedy).
  void finish(int64_t vocab_size, at::Device device);

 private:
  struct Round {
    at::Tensor probs;
    std::vector<int64_t> source_rows;           // rows of `probs` that became drafts
    std::vector<std::pair<size_t, size_t>> at;  // their (entry, draft index)
  };
  const ProposalContext& context_;
  Proposals& out_;
  bool greedy_ = true;
  bool argmax_only_ = true;  // greedy_, and no row changes its logits before the draw
  Sampler sampler_;
  std::vector<Round> rounds_;
};

}  // namespace kvserve::draft_sampling
