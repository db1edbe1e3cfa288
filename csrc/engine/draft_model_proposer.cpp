// DraftModelProposer: one draft forward over the step's tokens (its KV catching up with the
// target's), then one per further draft position over the speculating sequences only.
#include "kvserve/draft_model_proposer.h"

#include <algorithm>

#include "engine/draft_sampling.h"
#include "engine/engine_helpers.h"
#include "kvserve/forward_batch.h"

namespace kvserve {

using engine_helpers::make_kv_cache;
using engine_helpers::to_tensor;

namespace {

// Where one speculating entry stands in the draft loop.
struct Drafting {
  size_t entry;        // index into work.scheduled
  int64_t last;        // position of the last token fed so far
  int64_t wanted;      // draft slots
  bool done = false;
};

}  // namespace

DraftModelProposer::DraftModelProposer(std::shared_ptr<CausalLM> draft, int64_t num_blocks,
                                       int64_t block_size)
    : draft_(std::move(draft)), kv_cache_(make_kv_cache(*draft_, num_blocks, block_size)) {}

Proposals DraftModelProposer::propose(const ProposalContext& context) {
  const SchedulerOutput& work = context.work;
  Proposals out;
  out.tokens.resize(work.scheduled.size());

  draft_sampling::copy_blocks(kv_cache_, work);
  // A sequence that lost its blocks (finished, or preempted and readmitted: other blocks)
  // starts over when it runs again.
  draft_sampling::forget_readmitted(written_, context.sequences);
  bool any = false;
  for (size_t i = 0; i < work.scheduled.size(); ++i) {
    any = any || (context.rows[i] && work.scheduled[i].num_speculative_tokens > 0);
  }
  if (!any) return out;  // the draft does not run; it catches up when it next does

  // The catch-up forward: every scheduled sequence from where its draft KV ends. A sequence the
  // draft has not seen since it got its blocks starts at 0, prefix-cache hits included: the draft
  // computes its own KV for every position it reads (rewriting a shared block's positions with
  // the same values), so its proposals never depend on what other sequences left in the pool.
  ForwardBatchBuilder builder(kv_cache_.block_size());
  std::vector<Drafting> drafting;
  std::vector<int64_t> hidden_rows;
  int64_t num_rows = 0;
  for (size_t i = 0; i < work.scheduled.size(); ++i) {
    const ScheduledSequence& s = work.scheduled[i];
    const SequenceState& sequence = context.sequences.at(s.seq_id);
    const auto& tokens = sequence.token_ids;
    const int64_t end = s.num_computed + s.num_new_tokens;
    Written& written = written_[s.seq_id];
    const int64_t start = written.num_admissions == sequence.num_admissions
                              ? std::min(written.num_computed, s.num_computed)
                              : 0;
    builder.add(std::vector<int64_t>(tokens.begin() + start, tokens.begin() + end), start,
                s.block_tables.at(0));
    num_rows += end - start;
    written = {sequence.num_admissions, end};
    if (context.rows[i] && s.num_speculative_tokens > 0 && s.samples) {
      drafting.push_back({i, end - 1, s.num_speculative_tokens});
      hidden_rows.push_back(num_rows - 1);
    }
  }
  ForwardBatch batch = builder.build(draft_->device());
  at::Tensor hidden =
      draft_->forward(batch.input_ids, batch.positions, batch.metadata, kv_cache_.layers());
  const at::Device device = hidden.device();

  // One sampling round per draft position.
  std::vector<size_t> entries;
  for (const Drafting& d : drafting) entries.push_back(d.entry);
  draft_sampling::DraftRounds rounds(context, out, entries);
  std::vector<Drafting*> active;
  for (Drafting& d : drafting) active.push_back(&d);
  while (!active.empty()) {
    at::Tensor logits = draft_->compute_logits(hidden.index_select(0, to_tensor(hidden_rows, device)));
    entries.clear();
    for (Drafting* d : active) entries.push_back(d->entry);
    const std::vector<bool> drafted = rounds.sample(logits, entries);
    ForwardBatchBuilder next(kv_cache_.block_size());
    std::vector<Drafting*> still;
    for (size_t a = 0; a < active.size(); ++a) {
      Drafting& d = *active[a];
      const auto& so_far = out.tokens[d.entry];
      // No distribution (stop drafting), or its last draft.
      if (!drafted[a] || static_cast<int64_t>(so_far.size()) == d.wanted) continue;
      // Feed it: its KV goes to the next draft slot, its logits give the next draft.
      ++d.last;
      next.add({so_far.back()}, d.last, work.scheduled[d.entry].block_tables.at(0));
      written_[work.scheduled[d.entry].seq_id].num_computed = d.last + 1;
      still.push_back(&d);
    }
    active = std::move(still);
    if (active.empty()) break;
    batch = next.build(device);
    hidden = draft_->forward(batch.input_ids, batch.positions, batch.metadata, kv_cache_.layers());
    hidden_rows.resize(active.size());
    for (size_t a = 0; a < active.size(); ++a) hidden_rows[a] = static_cast<int64_t>(a);
  }
  rounds.finish(draft_->config().vocab_size, device);
  return out;
}

}  // namespace kvserve
