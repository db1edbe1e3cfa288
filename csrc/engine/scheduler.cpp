#include "kvserve/scheduler.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>

namespace kvserve {

void SchedulerConfig::validate() const {
  for (const auto& [name, value, least] :
       {std::tuple<const char*, int64_t, int64_t>{"max_num_seqs", max_num_seqs, 1},
        {"max_num_batched_tokens", max_num_batched_tokens, 1},
        {"max_model_len", max_model_len, 2}}) {
    if (value < least) {
      throw std::invalid_argument(std::string(name) + " must be >= " + std::to_string(least) +
                                  ", got " + std::to_string(value));
    }
  }
}

Scheduler::Scheduler(SchedulerConfig config, PagedBlockManager& blocks, SequenceTable& sequences)
    : config_(config), blocks_(blocks), sequences_(sequences) {
  config_.validate();
}

Scheduler::Entry& Scheduler::entry(int64_t seq_id) {
  auto it = entries_.find(seq_id);
  if (it == entries_.end()) {
    throw std::out_of_range("unknown sequence id " + std::to_string(seq_id));
  }
  return it->second;
}

const Scheduler::Entry& Scheduler::entry(int64_t seq_id) const {
  return const_cast<Scheduler*>(this)->entry(seq_id);
}

void Scheduler::add(int64_t seq_id, std::vector<int32_t> prompt_token_ids, int64_t priority,
                    int64_t max_new_tokens, int32_t lora_slot, uint64_t cache_key,
                    bool load_prompt, int64_t num_samples) {
  if (entries_.count(seq_id) || sequences_.contains(seq_id)) {
    throw std::invalid_argument("sequence id " + std::to_string(seq_id) + " already exists");
  }
  const int64_t len = static_cast<int64_t>(prompt_token_ids.size());
  if (len == 0) throw std::invalid_argument("the prompt is empty");
  if (len > config_.max_model_len) {
    throw std::invalid_argument("the prompt has " + std::to_string(len) +
                                " tokens; max_model_len is " +
                                std::to_string(config_.max_model_len));
  }
  for (int32_t t : prompt_token_ids) {
    if (t < 0) throw std::invalid_argument("negative token id " + std::to_string(t));
  }
  if (max_new_tokens < 1) throw std::invalid_argument("max_new_tokens must be >= 1");
  if (num_samples < 1) throw std::invalid_argument("num_samples must be >= 1");
  const int64_t num_states = blocks_.num_state_slots() > 0 ? num_samples : 1;
  if (num_states > std::max<int64_t>(blocks_.num_state_slots(), 1)) {
    throw std::invalid_argument("the request's " + std::to_string(num_samples) +
                                " samples need as many state slots; the pool has " +
                                std::to_string(blocks_.num_state_slots()) + " (max_num_seqs)");
  }
  const int64_t blocks_needed = blocks_.max_blocks_held(len, len, config_.max_num_batched_tokens);
  if (blocks_needed > blocks_.num_usable_blocks()) {
    throw std::invalid_argument("the prompt needs " + std::to_string(blocks_needed) +
                                " KV blocks; the cache has " +
                                std::to_string(blocks_.num_usable_blocks()));
  }
  SequenceState& state = sequences_.add({.seq_id = seq_id,
                                         .token_ids = std::move(prompt_token_ids),
                                         .num_prompt_tokens = len,
                                         .max_new_tokens = max_new_tokens,
                                         .priority = priority,
                                         .lora_slot = lora_slot,
                                         .cache_key = cache_key});
  entries_.emplace(seq_id, Entry{.state = &state,
                                 .arrival = next_arrival_++,
                                 .load_prompt = load_prompt,
                                 .num_states = num_states});
  enqueue_waiting(seq_id, /*preempted=*/false);
}

void Scheduler::set_lora(int64_t seq_id, int32_t lora_slot, uint64_t cache_key) {
  Entry& e = entry(seq_id);
  if (e.allocated) {
    throw std::logic_error("sequence " + std::to_string(seq_id) +
                           " holds blocks: its adapter cannot change");
  }
  e.state->lora_slot = lora_slot;
  e.state->cache_key = cache_key;
}

void Scheduler::enqueue_waiting(int64_t seq_id, bool preempted) {
  Entry& e = entry(seq_id);
  // A preempted sequence goes back to the front, ahead of every new one, whatever its priority.
  e.wait_key = preempted ? WaitKey{0, 0, -(next_preemption_order_++), seq_id}
                         : WaitKey{1, e.state->priority, e.arrival, seq_id};
  waiting_.insert(e.wait_key);
}

void Scheduler::start_running(int64_t seq_id) {
  Entry& e = entry(seq_id);
  e.allocated = true;
  e.running_pos = running_.insert(running_.end(), seq_id);
}

std::vector<int64_t> Scheduler::waiting() const {
  std::vector<int64_t> ids;
  for (const WaitKey& key : waiting_) ids.push_back(std::get<3>(key));
  return ids;
}

SchedulerOutput Scheduler::schedule(int64_t num_speculative_tokens) {
  if (num_speculative_tokens < 0) {
    throw std::invalid_argument("num_speculative_tokens must be >= 0");
  }
  SchedulerOutput out;
  // Snapshots planned for a step that did not run hold states never written.
  blocks_.discard_state_snapshots();
  int64_t budget = config_.max_num_batched_tokens;
  schedule_running(/*decodes=*/true, budget, out, num_speculative_tokens);
  schedule_running(/*decodes=*/false, budget, out, 0);
  // Like vLLM, admit nothing in a step that had to preempt: memory is short.
  if (out.preempted.empty()) admit_waiting(budget, out);
  for (const auto& s : out.scheduled) {
    out.num_batched_tokens += s.num_new_tokens + s.num_speculative_tokens;
  }
  describe(out);
  if (blocks_.keeps_state_backups()) {
    for (ScheduledSequence& sched : out.scheduled) {
      if (sched.num_speculative_tokens == 0 || sched.state_slot < 0) continue;
      sched.state_backup_slot = blocks_.back_up_state(sched.seq_id).dst;
      entry(sched.seq_id).state_backed_up_at = sched.num_computed;
    }
  }
  return out;
}

void Scheduler::describe(SchedulerOutput& out) const {
  for (ScheduledSequence& sched : out.scheduled) {
    const SequenceState& s = sequence(sched.seq_id);
    const auto first = s.token_ids.begin() + sched.num_computed;
    sched.token_ids.assign(first, first + sched.num_new_tokens);
    sched.block_tables.resize(blocks_.num_groups());
    for (int64_t g = 0; g < blocks_.num_groups(); ++g) {
      sched.block_tables[g] = blocks_.block_table(sched.seq_id, g);
    }
    sched.lora_slot = s.lora_slot;
    sched.state_slot = blocks_.state_slot(sched.seq_id);
    // A state after verified drafts is no state of the sequence's tokens: none is saved then.
    if (sched.num_speculative_tokens > 0) continue;
    const std::optional<StateCopy> snapshot =
        blocks_.snapshot_state(sched.seq_id, sched.num_computed + sched.num_new_tokens);
    if (snapshot) out.state_snapshots.push_back(*snapshot);
  }
  out.state_copies = blocks_.take_state_copies();
}

void Scheduler::schedule_running(bool decodes, int64_t& budget, SchedulerOutput& out,
                                 int64_t num_speculative_tokens) {
  const std::vector<int64_t> snapshot(running_.begin(), running_.end());
  for (int64_t id : snapshot) {
    if (budget == 0) return;
    if (!entry(id).allocated) continue;  // preempted earlier in this step
    const SequenceState& s = sequence(id);
    const int64_t remaining = s.num_tokens() - s.num_computed_tokens;
    // Nothing to compute: its last step's sample is not appended yet (asynchronous scheduling).
    if (remaining == 0 || (remaining == 1) != decodes) continue;
    const int64_t drafts = decodes ? reserve_draft_slots(id, num_speculative_tokens, budget, out)
                                   : 0;
    if (drafts == 0 && !reserve_slots(id, out)) continue;
    // A preemption inside reserve_slots may have dropped sequences scheduled earlier: refund.
    budget = config_.max_num_batched_tokens;
    for (const auto& sched : out.scheduled) {
      budget -= sched.num_new_tokens + sched.num_speculative_tokens;
    }
    const int64_t chunk = aligned_chunk(id, s.num_computed_tokens, std::min(remaining, budget));
    if (chunk == 0) return;
    // Sliding-window groups reserve prefill chunks as they come (a no-op otherwise, and for a
    // decode whose slot append_slots reserved).
    if (!reserve_prefill(id, s.num_computed_tokens + chunk, out)) continue;
    out.scheduled.push_back({.seq_id = id,
                             .num_computed = s.num_computed_tokens,
                             .num_new_tokens = chunk,
                             .samples = s.num_computed_tokens + chunk == s.num_tokens(),
                             .num_speculative_tokens = drafts});
    budget -= chunk + drafts;
  }
}

int64_t Scheduler::aligned_chunk(int64_t seq_id, int64_t num_computed, int64_t chunk) const {
  if (blocks_.num_state_snapshots() == 0) return chunk;
  const int64_t shared = blocks_.snapshot_boundary(seq_id);
  if (shared > num_computed && shared < num_computed + chunk) return shared - num_computed;
  const int64_t block = blocks_.block_size();
  const int64_t boundary = (num_computed + chunk) / block * block;
  return boundary > num_computed ? boundary - num_computed : chunk;
}

int64_t Scheduler::reserve_draft_slots(int64_t seq_id, int64_t wanted, int64_t budget,
                                       SchedulerOutput& out) {
  const SequenceState& s = sequence(seq_id);
  const int64_t len = s.num_tokens();
  // The prompt's first sample is never speculative (its n samples fork from those logits).
  if (wanted == 0 || len == s.num_prompt_tokens) return 0;
  // A step emits at most drafts + 1 tokens; none may pass the sequence's limits.
  const int64_t room =
      std::min(config_.max_model_len - len, s.max_new_tokens - s.num_output_tokens()) - 1;
  int64_t drafts = std::min({wanted, room, budget - 1});
  if (drafts <= 0) return 0;
  const int64_t held = blocks_.num_tokens(seq_id);
  if (!blocks_.can_append_slots(seq_id, len - held, drafts)) return 0;
  const std::vector<int32_t> tail(s.token_ids.begin() + held, s.token_ids.end());
  for (const BlockCopy& copy : blocks_.append_slots(seq_id, tail, drafts)) {
    out.block_copies.push_back(copy);
  }
  return drafts;
}

bool Scheduler::reserve_slots(int64_t seq_id, SchedulerOutput& out) {
  const SequenceState& s = sequence(seq_id);
  const int64_t held = blocks_.num_tokens(seq_id);
  const int64_t missing = s.num_tokens() - held;
  if (missing == 0 && blocks_.num_lookahead(seq_id) == 0) return true;
  while (!blocks_.can_append_slots(seq_id, missing)) {
    const bool self = running_.back() == seq_id;
    preempt_last(out);
    if (self) return false;
  }
  const std::vector<int32_t> tail(s.token_ids.begin() + held, s.token_ids.end());
  for (const BlockCopy& copy : blocks_.append_slots(seq_id, tail)) {
    out.block_copies.push_back(copy);
  }
  return true;
}

bool Scheduler::reserve_prefill(int64_t seq_id, int64_t end, SchedulerOutput& out) {
  while (!blocks_.can_reserve_prefill(seq_id, end)) {
    const bool self = running_.back() == seq_id;
    preempt_last(out);
    if (self) return false;
  }
  blocks_.reserve_prefill(seq_id, end);
  return true;
}

void Scheduler::preempt_last(SchedulerOutput& out) {
  const int64_t victim = running_.back();
  running_.pop_back();
  // Blocks it got this step (copy-on-write targets) go back to the pool: drop their copies, and
  // drop its share of the step.
  auto holds = [&](int32_t block) {
    for (int64_t g = 0; g < blocks_.num_groups(); ++g) {
      const std::vector<int32_t>& table = blocks_.block_table(victim, g);
      if (std::find(table.begin(), table.end(), block) != table.end()) return true;
    }
    return false;
  };
  out.block_copies.erase(
      std::remove_if(out.block_copies.begin(), out.block_copies.end(),
                     [&](const BlockCopy& c) {
                       return holds(c.dst) && blocks_.ref_count(c.dst) == 1;
                     }),
      out.block_copies.end());
  out.scheduled.erase(std::remove_if(out.scheduled.begin(), out.scheduled.end(),
                                     [&](const ScheduledSequence& s) { return s.seq_id == victim; }),
                      out.scheduled.end());
  blocks_.free(victim);
  entry(victim).allocated = false;
  entry(victim).state->num_computed_tokens = 0;
  enqueue_waiting(victim, /*preempted=*/true);
  out.preempted.push_back(victim);
  ++num_preemptions_;
}

void Scheduler::admit_waiting(int64_t& budget, SchedulerOutput& out) {
  // Sequences whose adapter waits for a slot are passed over, not waited on.
  auto next = waiting_.begin();
  while (next != waiting_.end() && budget > 0 &&
         static_cast<int64_t>(running_.size() + loading_.size()) < config_.max_num_seqs) {
    const int64_t id = std::get<3>(*next);
    SequenceState& s = *entry(id).state;
    if (s.lora_slot == kLoraPending) {
      ++next;
      continue;
    }
    if (entry(id).load_prompt && s.num_output_tokens() == 0) {
      const auto after = std::next(next);  // (admit_load takes it off waiting_)
      if (!admit_load(id)) return;
      next = after;
      out.loads.push_back(id);
      continue;
    }
    // The watermark keeps headroom for running sequences' growth; with nothing running there is
    // nothing to protect, so a sequence that fits the pool at all is admitted.
    // Sliding-window groups reserve the first chunk only (at most the budget after the hit).
    const int64_t num_states = entry(id).num_states;
    if (!blocks_.can_allocate(s.token_ids, s.cache_key, budget, num_states) &&
        !running_.empty()) {
      return;
    }
    int64_t cached = 0;
    try {
      cached = blocks_.allocate(id, s.token_ids, s.cache_key, budget, num_states);
    } catch (const std::runtime_error&) {
      return;  // not enough free blocks (only reachable with nothing running)
    }
    next = waiting_.erase(next);
    start_running(id);
    s.num_computed_tokens = cached;
    s.num_cached_tokens = cached;
    ++s.num_admissions;
    const int64_t remaining = s.num_tokens() - cached;
    const int64_t chunk = aligned_chunk(id, cached, std::min(remaining, budget));
    out.scheduled.push_back({.seq_id = id,
                             .num_computed = cached,
                             .num_new_tokens = chunk,
                             .samples = chunk == remaining});
    budget -= chunk;
    // This step's forward writes the chunk's K/V before any of its attention reads the cache, so
    // sequences admitted after this one in the same step may already reuse its full blocks. (No
    // preemption follows admission within a step, so the chunk does run.)
    blocks_.mark_computed(id, cached + chunk);
  }
}

bool Scheduler::admit_load(int64_t seq_id) {
  SequenceState& s = *entry(seq_id).state;
  // Blocks for the whole prompt in every group: the transfer writes them all at once.
  if (!blocks_.can_allocate(s.token_ids, s.cache_key, -1) && !running_.empty()) return false;
  int64_t cached = 0;
  try {
    cached = blocks_.allocate(seq_id, s.token_ids, s.cache_key, -1);
  } catch (const std::runtime_error&) {
    return false;
  }
  // The transfer brings the state at the prompt's end: a prefix hit's saved state is not copied
  // in (the transfer would overwrite it).
  blocks_.discard_state_copies_to(blocks_.state_slot(seq_id));
  Entry& e = entry(seq_id);
  waiting_.erase(e.wait_key);
  e.allocated = true;
  loading_.emplace(seq_id, false);
  s.num_computed_tokens = cached;
  s.num_cached_tokens = cached;
  ++s.num_admissions;
  return true;
}

bool Scheduler::end_load(int64_t seq_id, bool ok) {
  auto it = loading_.find(seq_id);
  if (it == loading_.end()) {
    throw std::out_of_range("sequence " + std::to_string(seq_id) + " is not loading");
  }
  const bool finished = it->second;
  loading_.erase(it);
  if (!ok || finished) {
    blocks_.free(seq_id);
    entries_.erase(seq_id);
    sequences_.erase(seq_id);
    return false;
  }
  SequenceState& s = *entry(seq_id).state;
  s.num_computed_tokens = s.num_tokens();
  blocks_.mark_computed(seq_id, s.num_computed_tokens);
  entry(seq_id).running_pos = running_.insert(running_.end(), seq_id);
  return true;
}

void Scheduler::hold(int64_t seq_id) {
  Entry& e = entry(seq_id);
  if (!e.allocated || loading_.count(seq_id)) {
    throw std::out_of_range("sequence " + std::to_string(seq_id) + " is not running");
  }
  running_.erase(e.running_pos);
  entries_.erase(seq_id);
  sequences_.erase(seq_id);
  held_.insert(seq_id);
}

void Scheduler::release(int64_t seq_id) {
  if (!held_.erase(seq_id)) {
    throw std::out_of_range("sequence " + std::to_string(seq_id) + " is not held");
  }
  blocks_.free(seq_id);
}

void Scheduler::update_computed(const SchedulerOutput& output) {
  for (const ScheduledSequence& sched : output.scheduled) {
    SequenceState& s = *entry(sched.seq_id).state;
    if (s.num_computed_tokens != sched.num_computed) {
      throw std::logic_error("update_computed: sequence " + std::to_string(sched.seq_id) +
                             " changed since it was scheduled");
    }
    s.num_computed_tokens += sched.num_new_tokens;
    blocks_.mark_computed(sched.seq_id, s.num_computed_tokens);
  }
}

void Scheduler::settle_speculative_state(int64_t seq_id, bool all_accepted) {
  Entry& e = entry(seq_id);
  const int64_t at = std::exchange(e.state_backed_up_at, -1);
  if (at < 0 || all_accepted) return;
  blocks_.restore_state(seq_id, at);
  e.state->num_computed_tokens = at;
}

void Scheduler::append_token(int64_t seq_id, int32_t token, bool kv_written) {
  const Entry& e = entry(seq_id);
  SequenceState& s = *e.state;
  const int64_t len = s.num_tokens();
  if (len >= config_.max_model_len) {
    throw std::logic_error("sequence " + std::to_string(seq_id) + " is at max_model_len");
  }
  if (!kv_written) {
    s.token_ids.push_back(token);
    // Draft slots left over from the step (rejected drafts) go back until the next schedule.
    if (e.allocated && blocks_.num_lookahead(seq_id) > 0) blocks_.append_slots(seq_id, {}, 0);
    return;
  }
  const int64_t lookahead = e.allocated ? blocks_.num_lookahead(seq_id) : 0;
  if (s.num_computed_tokens != len || blocks_.num_tokens(seq_id) != len || lookahead == 0) {
    throw std::logic_error("append_token: sequence " + std::to_string(seq_id) +
                           " has no computed draft slot for an accepted token");
  }
  s.token_ids.push_back(token);
  blocks_.append_slots(seq_id, {token}, lookahead - 1);
  blocks_.mark_computed(seq_id, ++s.num_computed_tokens);
}

void Scheduler::set_pending_token(int64_t seq_id, int32_t token) {
  const Entry& e = entry(seq_id);
  SequenceState& s = *e.state;
  if (s.token_ids.empty() || s.token_ids.back() != kPendingToken || token < 0) {
    throw std::invalid_argument("set_pending_token: sequence " + std::to_string(seq_id) +
                                " has no pending last token, or the token " +
                                std::to_string(token) + " is negative");
  }
  // The block manager holds the token once a schedule reserved its slot.
  if (e.allocated && blocks_.num_tokens(seq_id) == s.num_tokens()) {
    blocks_.set_pending_token(seq_id, token);
  }
  s.token_ids.back() = token;
}

void Scheduler::fork(int64_t parent_id, int64_t child_id) {
  const Entry& parent = entry(parent_id);
  if (!parent.allocated) throw std::invalid_argument("fork: the parent is not running");
  if (entries_.count(child_id) || sequences_.contains(child_id)) {
    throw std::invalid_argument("sequence id " + std::to_string(child_id) + " already exists");
  }
  blocks_.fork(parent_id, child_id);
  entry(parent_id).num_states = 1;  // its samples have their slots now
  Entry child = parent;
  child.num_states = 1;
  child.state = &sequences_.fork(parent_id, child_id);
  entries_.emplace(child_id, child);
  start_running(child_id);
}

void Scheduler::finish(int64_t seq_id) {
  Entry& e = entry(seq_id);
  if (auto loading = loading_.find(seq_id); loading != loading_.end()) {
    loading->second = true;  // end_load frees its blocks: the transfer may still write them
    return;
  }
  if (e.allocated) {
    blocks_.free(seq_id);
    running_.erase(e.running_pos);
  } else {
    waiting_.erase(e.wait_key);
  }
  entries_.erase(seq_id);
  sequences_.erase(seq_id);
}

void Scheduler::check_invariants() const {
  auto fail = [](const std::string& what) { throw std::logic_error("Scheduler: " + what); };
  if (running_.size() + waiting_.size() + loading_.size() != entries_.size()) {
    fail("queues and sequences differ");
  }
  for (const auto& [id, e] : entries_) {
    if (!sequences_.contains(id) || &sequences_.at(id) != e.state) {
      fail("sequence " + std::to_string(id) + " is not the table's");
    }
  }
  if (blocks_.num_sequences() !=
      static_cast<int64_t>(running_.size() + loading_.size() + held_.size())) {
    fail("the block manager holds other sequences than the running, loading and held ones");
  }
  for (const auto& [id, finished] : loading_) {
    if (!entries_.count(id) || !entry(id).allocated || !blocks_.has_sequence(id)) {
      fail("a loading sequence holds no blocks");
    }
  }
  for (int64_t id : held_) {
    if (entries_.count(id) || !blocks_.has_sequence(id)) fail("a held sequence is queued");
  }
  for (int64_t id : running_) {
    const SequenceState& s = sequence(id);
    if (!entry(id).allocated || !blocks_.has_sequence(id)) {
      fail("a running sequence holds no blocks");
    }
    const int64_t held = blocks_.num_tokens(id);
    if (s.num_computed_tokens > held || held > s.num_tokens()) {
      fail("computed <= reserved <= tokens does not hold for " + std::to_string(id));
    }
  }
  for (const WaitKey& key : waiting_) {
    const int64_t id = std::get<3>(key);
    if (entry(id).allocated || blocks_.has_sequence(id)) fail("a waiting sequence holds blocks");
    if (entry(id).wait_key != key) fail("a waiting sequence's key is stale");
  }
  blocks_.check_invariants();
}

}  // namespace kvserve
