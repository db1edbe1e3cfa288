// HeadProposer: per step, one forward per depth over every scheduled sequence's rows that are
// due (the catch-up, which also drafts one token per depth), then one per further draft; none in
// a step where no sequence drafts.
#include "kvserve/head_proposer.h"

#include <ATen/ops/cat.h>

#include <algorithm>

#include "engine/draft_sampling.h"
#include "engine/engine_helpers.h"
#include "kvserve/forward_batch.h"
#include "kvserve/tensor_parallel_worker.h"
#include "models/draft_head.h"

namespace kvserve {

using engine_helpers::make_kv_cache;
using engine_helpers::to_tensor;

namespace {

// One scheduled sequence's rows in this step: positions [start, stop) of depth 0.
struct Run {
  size_t entry;      // index into work.scheduled
  int64_t start = 0;
  int64_t stop = 0;
  int64_t wanted = 0;   // drafts (0: it only catches up)
  at::Tensor previous;  // [rows, width]: what the next depth (or draft) reads
  int64_t last = 0;     // position of the last row fed
};

}  // namespace

HeadProposer::HeadProposer(std::shared_ptr<DraftHead> head, int64_t num_blocks, int64_t block_size,
                           std::shared_ptr<Communicator> workers)
    : head_(std::move(head)), kv_cache_(make_kv_cache(*head_, num_blocks, block_size)) {
  const std::shared_ptr<Communicator> ranks = head_->ranks();
  if (ranks && ranks->size() > 1) {
    if (!workers || workers->size() != ranks->size()) {
      throw std::invalid_argument(
          "a speculative head split over " + std::to_string(ranks->size()) +
          " ranks needs the control group of as many tensor-parallel ranks");
    }
    workers_ = std::move(workers);
  }
}

Proposals HeadProposer::propose(const ProposalContext& context) {
  const SchedulerOutput& work = context.work;
  Proposals out;
  out.tokens.resize(work.scheduled.size());
  draft_sampling::copy_blocks(kv_cache_, work);
  if (workers_) {
    for (const BlockCopy& c : work.block_copies) pending_copies_.emplace_back(c.src, c.dst);
  }
  // The head's forward and logits, run by every rank of a split head (the workers told first).
  const auto forward_depth = [&](int64_t d, const ForwardBatchBuilder& builder,
                                 const at::Tensor& previous) {
    if (workers_) {
      send_draft_depth(*workers_, *head_->ranks(), d, pending_copies_, previous, builder);
      pending_copies_.clear();
    }
    const ForwardBatch batch = builder.build(head_->device());
    return head_->forward_depth(d, batch.input_ids, previous, batch.positions, batch.metadata,
                                kv_cache_.layers());
  };
  const auto compute_logits = [&](const at::Tensor& hidden) {
    if (workers_) send_draft_logits(*workers_, *head_->ranks(), hidden);
    return head_->compute_logits(hidden);
  };
  draft_sampling::forget_readmitted(tracks_, context.sequences);

  const int64_t num_depths = head_->num_depths();
  std::vector<Run> runs;
  std::vector<size_t> drafting_entries;
  for (size_t i = 0; i < work.scheduled.size(); ++i) {
    const ScheduledSequence& s = work.scheduled[i];
    const SequenceState& sequence = context.sequences.at(s.seq_id);
    auto [it, added] = tracks_.try_emplace(s.seq_id);
    Track& track = it->second;
    if (added) track.num_admissions = sequence.num_admissions;
    if (!track.hidden.defined()) continue;
    // The target's hidden states are known (and final) up to the positions it computed.
    const int64_t stop = std::min(s.num_computed, track.first + track.hidden.size(0));
    if (stop <= track.first) continue;
    Run run{i, track.first, stop};
    run.previous = track.hidden.narrow(0, 0, stop - track.first);
    // Drafts need the head's rows up to the token the step feeds: a decoding sequence's.
    const bool decoding = s.num_new_tokens == 1 && stop == s.num_computed &&
                          sequence.num_tokens() == s.num_computed + 1;
    if (context.rows[i] && s.samples && decoding && s.num_speculative_tokens > 0) {
      run.wanted = s.num_speculative_tokens;
      drafting_entries.push_back(i);
    }
    runs.push_back(std::move(run));
  }

  if (drafting_entries.empty()) {
    // Nobody drafts this step (the batch rule paused speculation): the head does not run, and
    // what it held of the target is dropped, so that a paused head costs nothing. When drafting
    // resumes the head starts from the states of that step on; its rows for the positions in
    // between stay unwritten, as a prefix-cache hit's (drafts may be worse, outputs never change).
    for (const ScheduledSequence& s : work.scheduled) tracks_.at(s.seq_id).hidden = at::Tensor();
    return out;
  }

  draft_sampling::DraftRounds rounds(context, out, drafting_entries);
  // One draft per run in `drafting` from `logits` (a row each, in order); a run whose row holds
  // no distribution stops drafting.
  const auto sample = [&](const at::Tensor& logits, const std::vector<Run*>& drafting) {
    std::vector<size_t> entries;
    for (Run* r : drafting) entries.push_back(r->entry);
    const std::vector<bool> drafted = rounds.sample(logits, entries);
    for (size_t a = 0; a < drafting.size(); ++a) {
      if (!drafted[a]) drafting[a]->wanted = static_cast<int64_t>(out.tokens[entries[a]].size());
    }
  };

  // Depth d: each run's rows whose token (d + 1 positions on) is known, or drafted already.
  const at::Device device = head_->device();
  for (int64_t d = 0; d < num_depths && !runs.empty(); ++d) {
    ForwardBatchBuilder builder(kv_cache_.block_size());
    std::vector<at::Tensor> previous;
    std::vector<Run*> fed, drafting;
    std::vector<int64_t> last_rows;
    int64_t num_rows = 0;
    for (Run& r : runs) {
      const ScheduledSequence& s = work.scheduled[r.entry];
      const auto& history = context.sequences.at(s.seq_id).token_ids;
      const auto& drafts = out.tokens[r.entry];
      const bool drafts_here = r.wanted > d && static_cast<int64_t>(drafts.size()) == d;
      const int64_t known = static_cast<int64_t>(history.size()) - d - 1;
      const int64_t stop = drafts_here ? r.stop : std::min(r.stop, known);
      if (stop <= r.start) continue;
      std::vector<int64_t> tokens;
      for (int64_t p = r.start; p < stop; ++p) {
        const int64_t at = p + d + 1;
        tokens.push_back(at < static_cast<int64_t>(history.size())
                             ? history[at]
                             : drafts[at - static_cast<int64_t>(history.size())]);
      }
      builder.add(tokens, r.start, s.block_tables.at(0));
      previous.push_back(r.previous.narrow(0, 0, stop - r.start));
      num_rows += stop - r.start;
      fed.push_back(&r);
      r.last = stop - 1;
      if (drafts_here) {
        drafting.push_back(&r);
        last_rows.push_back(num_rows - 1);
      }
    }
    if (fed.empty()) break;
    const DraftHead::Output out_d = forward_depth(d, builder, at::cat(previous, 0));
    int64_t row = 0;
    for (Run* r : fed) {
      const int64_t n = r->last + 1 - r->start;
      r->previous = out_d.for_next.narrow(0, row, n);
      row += n;
    }
    if (!drafting.empty()) {
      sample(compute_logits(out_d.for_logits.index_select(0, to_tensor(last_rows, device))),
             drafting);
    }
  }

  // Further drafts: the last depth reads its own output and draft, one position on.
  std::vector<Run*> active;
  for (Run& r : runs) {
    if (r.wanted > static_cast<int64_t>(out.tokens[r.entry].size()) &&
        static_cast<int64_t>(out.tokens[r.entry].size()) == num_depths) {
      active.push_back(&r);
    }
  }
  while (!active.empty()) {
    ForwardBatchBuilder builder(kv_cache_.block_size());
    std::vector<at::Tensor> previous;
    for (Run* r : active) {
      ++r->last;
      builder.add({out.tokens[r->entry].back()}, r->last,
                  work.scheduled[r->entry].block_tables.at(0));
      previous.push_back(r->previous.narrow(0, r->previous.size(0) - 1, 1));
    }
    const DraftHead::Output out_d = forward_depth(num_depths - 1, builder, at::cat(previous, 0));
    for (size_t a = 0; a < active.size(); ++a) {
      active[a]->previous = out_d.for_next.narrow(0, static_cast<int64_t>(a), 1);
    }
    sample(compute_logits(out_d.for_logits), active);
    std::vector<Run*> still;
    for (Run* r : active) {
      if (r->wanted > static_cast<int64_t>(out.tokens[r->entry].size())) still.push_back(r);
    }
    active = std::move(still);
  }

  // Keep the target states of the rows some depth must run again: those that read a draft.
  for (const Run& r : runs) {
    const ScheduledSequence& s = work.scheduled[r.entry];
    Track& track = tracks_.at(s.seq_id);
    const int64_t known = context.sequences.at(s.seq_id).num_tokens() - num_depths;
    const int64_t next = std::max(r.start, std::min(r.stop, known));
    track.hidden = track.hidden.narrow(0, next - track.first, r.stop - next);
    track.first = next;
  }

  rounds.finish(head_->config().vocab_size, device);
  return out;
}

void HeadProposer::observe(const SchedulerOutput& work, const std::vector<int64_t>& starts,
                           const at::Tensor& hidden) {
  if (work.scheduled.empty()) return;
  const at::Tensor states = head_->target_states(hidden);
  for (size_t i = 0; i < work.scheduled.size(); ++i) {
    const ScheduledSequence& s = work.scheduled[i];
    auto it = tracks_.find(s.seq_id);
    if (it == tracks_.end()) continue;  // propose() saw every scheduled sequence
    Track& track = it->second;
    const at::Tensor rows = states.narrow(0, starts[i], starts[i + 1] - starts[i]);
    const int64_t kept = track.hidden.defined() ? s.num_computed - track.first : -1;
    if (kept >= 0 && kept <= track.hidden.size(0)) {  // continues what it holds
      track.hidden = at::cat({track.hidden.narrow(0, 0, kept), rows}, 0);
    } else {
      track.first = s.num_computed;
      track.hidden = rows.clone();
    }
  }
}

}  // namespace kvserve
