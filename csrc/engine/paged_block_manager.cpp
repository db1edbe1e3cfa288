#include "kvserve/paged_block_manager.h"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>

#include "engine/paged_block_manager_detail.h"

namespace kvserve {

using namespace block_manager_detail;

namespace {

void check_tokens(const std::vector<int32_t>& tokens, const char* what) {
  for (int32_t token : tokens) {
    if (token < 0) {
      throw std::invalid_argument(std::string(what) + ": token ids must be non-negative, got " +
                                  std::to_string(token));
    }
  }
}

// append_slots' tokens: kPendingToken may stand last (asynchronous scheduling).
void check_new_tokens(const std::vector<int32_t>& tokens) {
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 && !(tokens[i] == kPendingToken && i + 1 == tokens.size())) {
      throw std::invalid_argument("append_slots: token ids must be non-negative, got " +
                                  std::to_string(tokens[i]));
    }
  }
}

void check_prompt(const std::vector<int32_t>& prompt_tokens, const char* what) {
  if (prompt_tokens.empty()) throw std::invalid_argument(std::string(what) + ": empty prompt");
  check_tokens(prompt_tokens, what);
}

}  // namespace

PagedBlockManager::PagedBlockManager(BlockManagerOptions options)
    : block_size_(options.block_size),

      enable_prefix_caching_(options.enable_prefix_caching),
      hash_fn_(options.hash_fn ? std::move(options.hash_fn) : BlockHashFn(&default_block_hash)),
      pool_(options.num_blocks) {
  const int64_t num_blocks = options.num_blocks;
  const double watermark = options.watermark;
  if (block_size_ < 1) {
    throw std::invalid_argument("PagedBlockManager: block_size must be >= 1, got " +
                                std::to_string(block_size_));
  }
  const std::vector<int64_t>& windows = options.group_windows;
  if (windows.empty() ||
      std::any_of(windows.begin(), windows.end(), [](int64_t w) { return w < 0; })) {
    throw std::invalid_argument("PagedBlockManager: need one window >= 0 per group of layers");
  }
  for (int64_t window : windows) groups_.emplace_back(window, block_size_);
  if (!(watermark >= 0.0 && watermark < 1.0)) {
    throw std::invalid_argument("PagedBlockManager: watermark must be in [0, 1), got " +
                                std::to_string(watermark));
  }
  // Rounded down, as vLLM does: a tiny pool keeps no watermark.
  watermark_blocks_ = static_cast<int64_t>(watermark * static_cast<double>(num_blocks - 1));
  if (options.num_state_slots < 0 || options.num_state_slots > std::numeric_limits<int32_t>::max()) {
    throw std::invalid_argument("PagedBlockManager: num_state_slots must be in [0, 2^31), got " +
                                std::to_string(options.num_state_slots));
  }
  const int64_t snapshots = options.num_state_snapshots;
  if (snapshots < 0 || snapshots > std::numeric_limits<int32_t>::max() - options.num_state_slots ||
      (snapshots > 0 && (options.num_state_slots == 0 || !enable_prefix_caching_))) {
    throw std::invalid_argument("PagedBlockManager: num_state_snapshots must be >= 0, and > 0 "
                                "only with state slots and prefix caching, got " +
                                std::to_string(snapshots));
  }
  if (options.num_state_slots > 0 && enable_prefix_caching_ &&
      (snapshots == 0 || !groups_[0].chains_parents())) {
    throw std::invalid_argument("PagedBlockManager: prefix caching with state slots needs state "
                                "snapshots (a hit must end where a state was saved) and a first "
                                "group of full attention");
  }
  num_state_slots_ = options.num_state_slots;
  for (int64_t slot = num_state_slots_ - 1; slot >= 0; --slot) {
    free_states_.push_back(static_cast<int32_t>(slot));
  }
  num_state_snapshots_ = snapshots;
  for (int64_t slot = num_state_slots_ + snapshots - 1; slot >= num_state_slots_; --slot) {
    free_snapshots_.push_back(static_cast<int32_t>(slot));
  }
  state_backups_ = options.state_backups && num_state_slots_ > 0;
}

StateCopy PagedBlockManager::back_up_state(int64_t seq_id) const {
  const Sequence& seq = sequence(seq_id);
  if (!state_backups_ || seq.state_slot < 0) {
    throw std::logic_error("back_up_state: sequence " + std::to_string(seq_id) +
                           " has no backup slot (a state pool with state_backups)");
  }
  const auto backup = static_cast<int32_t>(num_state_slots_ + num_state_snapshots_ +
                                           seq.state_slot);
  return StateCopy{seq.state_slot, backup};
}

void PagedBlockManager::restore_state(int64_t seq_id, int64_t num_computed_tokens) {
  const StateCopy backup = back_up_state(seq_id);
  Sequence& seq = sequence(seq_id);
  if (num_computed_tokens < 0 || num_computed_tokens > seq.num_computed) {
    throw std::invalid_argument("restore_state: sequence " + std::to_string(seq_id) + " has " +
                                std::to_string(seq.num_computed) +
                                " tokens computed; cannot go back to " +
                                std::to_string(num_computed_tokens));
  }
  state_copies_.push_back({backup.dst, backup.src});
  seq.num_computed = num_computed_tokens;
}

uint64_t PagedBlockManager::default_block_hash(uint64_t parent_hash, const int32_t* tokens,
                                               int64_t num_tokens, uint64_t extra_key) {
  uint64_t hash = combine(parent_hash, extra_key);
  for (int64_t i = 0; i < num_tokens; ++i) {
    hash = combine(hash, static_cast<uint32_t>(tokens[i]));
  }
  return hash;
}

// ---------------------------------------------------------------------------------------------
// Sequences

const PagedBlockManager::Sequence& PagedBlockManager::sequence(int64_t seq_id) const {
  const auto it = sequences_.find(seq_id);
  if (it == sequences_.end()) {
    throw std::out_of_range("PagedBlockManager: unknown sequence id " + std::to_string(seq_id));
  }
  return it->second;
}

PagedBlockManager::Sequence& PagedBlockManager::sequence(int64_t seq_id) {
  return const_cast<Sequence&>(static_cast<const PagedBlockManager*>(this)->sequence(seq_id));
}

int64_t PagedBlockManager::num_tokens(int64_t seq_id) const {
  return static_cast<int64_t>(sequence(seq_id).tokens.size());
}

int64_t PagedBlockManager::num_live_blocks(int64_t seq_id, int64_t group) const {
  const std::vector<int32_t>& table = sequence(seq_id).tables.at(group);
  return std::count_if(table.begin(), table.end(), [](int32_t b) { return b != kNullBlock; });
}

int64_t PagedBlockManager::max_blocks_held(int64_t num_prompt, int64_t num_tokens,
                                           int64_t max_chunk) const {
  return max_blocks_held(group_windows(), block_size_, num_prompt, num_tokens, max_chunk);
}

std::vector<int64_t> PagedBlockManager::group_windows() const {
  std::vector<int64_t> windows;
  for (const BlockTablePolicy& group : groups_) windows.push_back(group.window());
  return windows;
}

int64_t PagedBlockManager::max_blocks_held(const std::vector<int64_t>& group_windows,
                                           int64_t block_size, int64_t num_prompt,
                                           int64_t num_tokens, int64_t max_chunk) {
  auto held = [&](int64_t length, int64_t chunk) {
    int64_t blocks = 0;
    for (const int64_t window : group_windows) {
      blocks += BlockTablePolicy(window, block_size).max_blocks_held(length, chunk);
    }
    return blocks;
  };
  return std::max(held(num_prompt, std::min(max_chunk, num_prompt)), held(num_tokens, 1));
}

// ---------------------------------------------------------------------------------------------
// Allocation

namespace {

// Tokens the first step computes after a hit of num_hit tokens.
int64_t first_chunk(int64_t num_prompt, int64_t num_hit, int64_t num_scheduled) {
  const int64_t rest = num_prompt - num_hit;
  return num_scheduled < 0 ? rest : std::min(rest, num_scheduled);
}

}  // namespace

// New blocks for the prompt (a local group's only up to sliding_end) plus the free hit blocks.
int64_t PagedBlockManager::num_blocks_to_admit(const PrefixMatch& match, int64_t num_prompt,
                                               int64_t sliding_end) const {
  int64_t num_taken = 0;
  for (int64_t g = 0; g < num_groups(); ++g) {
    num_taken += groups_[g].table_size(num_prompt, sliding_end) - match.num_blocks +
                 num_free_among(match.blocks[g]);
  }
  return num_taken;
}

bool PagedBlockManager::can_allocate(const std::vector<int32_t>& prompt_tokens,
                                     uint64_t extra_key, int64_t num_scheduled,
                                     int64_t num_states) const {
  check_prompt(prompt_tokens, "can_allocate");
  const int64_t num_prompt = static_cast<int64_t>(prompt_tokens.size());
  const PrefixMatch match = match_prefix(prompt_tokens, extra_key);
  const int64_t hit = match.num_blocks * block_size_;
  const int64_t sliding_end = hit + first_chunk(num_prompt, hit, num_scheduled);
  const int64_t num_taken = num_blocks_to_admit(match, num_prompt, sliding_end);
  if (num_state_slots_ > 0 && num_free_state_slots() < std::max<int64_t>(num_states, 1)) {
    return false;
  }
  return num_free_blocks() - num_taken >= watermark_blocks_;
}

int64_t PagedBlockManager::allocate(int64_t seq_id, const std::vector<int32_t>& prompt_tokens,
                                    uint64_t extra_key, int64_t num_scheduled,
                                    int64_t num_states) {
  check_prompt(prompt_tokens, "allocate");
  if (has_sequence(seq_id)) {
    throw std::invalid_argument("allocate: sequence id " + std::to_string(seq_id) +
                                " is already allocated");
  }
  if (num_states < 1) {
    throw std::invalid_argument("allocate: num_states must be >= 1, got " +
                                std::to_string(num_states));
  }
  if (num_state_slots_ > 0 && num_states > num_free_state_slots()) {
    throw std::runtime_error("allocate: sequence " + std::to_string(seq_id) + " needs " +
                             std::to_string(num_states) + " free state slots (" +
                             std::to_string(num_free_state_slots()) + " free)");
  }
  const int64_t num_prompt = static_cast<int64_t>(prompt_tokens.size());
  const PrefixMatch match = match_prefix(prompt_tokens, extra_key);
  const int64_t hit = match.num_blocks * block_size_;
  const int64_t sliding_end = hit + first_chunk(num_prompt, hit, num_scheduled);
  const int64_t num_taken = num_blocks_to_admit(match, num_prompt, sliding_end);
  if (num_taken > num_free_blocks()) {
    throw std::runtime_error("allocate: sequence " + std::to_string(seq_id) + " needs " +
                             std::to_string(num_taken) + " free KV cache blocks (" +
                             std::to_string(num_free_blocks()) + " free)");
  }
  Sequence seq;
  seq.tokens = prompt_tokens;
  seq.extra_key = extra_key;
  if (num_state_slots_ > 0) {  // nothing below throws: the slots are taken for good
    seq.state_slot = take_free_state();
    for (int64_t i = 1; i < num_states; ++i) seq.reserved_states.push_back(take_free_state());
  }
  seq.tables.resize(num_groups());
  seq.live_from.assign(num_groups(), 0);
  seq.chain_refs.assign(num_groups(), BlockRef{kNullBlock, 0});
  seq.sliding_end = sliding_end;
  // Take the hits out of the free queue before new blocks are popped, which may evict.
  for (int64_t g = 0; g < num_groups(); ++g) {
    std::vector<int32_t>& table = seq.tables[g];
    table.assign(match.first[g], kNullBlock);
    seq.live_from[g] = match.first[g];
    for (int32_t b : match.blocks[g]) {
      pool_.acquire(b);
      table.push_back(b);
    }
    if (groups_[g].chains_parents() && !match.blocks[g].empty()) {
      seq.chain_refs[g] = pool_.ref(match.blocks[g].back());
    }
  }
  for (int64_t g = 0; g < num_groups(); ++g) {
    resize_table(seq.tables[g], groups_[g].table_size(num_prompt, sliding_end));
  }
  seq.num_computed = hit;
  seq.num_hashed = match.num_blocks;
  seq.chain_hash = match.last_hash;
  if (num_state_snapshots_ > 0 && match.num_shared_blocks > match.num_blocks) {
    seq.snapshot_end = match.num_shared_blocks * block_size_;
  }
  if (match.state_source >= 0) {  // the state at the hit's end, before the step reads it
    state_copies_.push_back({match.state_source, seq.state_slot});
    snapshots_.at(match.last_hash).last_used = ++snapshot_clock_;
  }
  if (enable_prefix_caching_) {
    prefix_cache_queries_ += num_prompt;
    prefix_cache_hits_ += hit;
  }
  sequences_.emplace(seq_id, std::move(seq));
  return hit;
}

// ---------------------------------------------------------------------------------------------
// Growing and shrinking tables

// The next write lands in the last token's block; a shared one must be copied first.
bool PagedBlockManager::needs_copy_on_write(const Sequence& seq, int64_t group) const {
  const int64_t num_tokens = static_cast<int64_t>(seq.tokens.size());
  const std::vector<int32_t>& table = seq.tables[group];
  const int64_t index = num_tokens / block_size_;
  return num_tokens % block_size_ != 0 && index < static_cast<int64_t>(table.size()) &&
         table[index] != kNullBlock && pool_.ref_count(table[index]) > 1;
}

int64_t PagedBlockManager::num_blocks_to_take(const Sequence& seq, int64_t full_end,
                                              int64_t sliding_end) const {
  int64_t num_new = 0;
  for (int64_t g = 0; g < num_groups(); ++g) {
    const std::vector<int32_t>& table = seq.tables[g];
    const int64_t size = static_cast<int64_t>(table.size());
    num_new += groups_[g].table_size(full_end, sliding_end) - size;
    // Blocks the window leaves behind and no other table holds come back to the pool first.
    const int64_t first = std::min(groups_[g].first_visible_block(seq.num_computed), size);
    for (int64_t i = seq.live_from[g]; i < first; ++i) {
      num_new -= table[i] != kNullBlock && pool_.ref_count(table[i]) == 1;
    }
  }
  return num_new;
}

void PagedBlockManager::drop_out_of_window(Sequence& seq) {
  for (int64_t g = 0; g < num_groups(); ++g) {
    std::vector<int32_t>& table = seq.tables[g];
    const int64_t first =
        std::min(groups_[g].first_visible_block(seq.num_computed),
                 static_cast<int64_t>(table.size()));
    // Oldest first: they reach the cached end of the free queue first, so they are evicted
    // before the newer blocks of the window.
    for (; seq.live_from[g] < first; ++seq.live_from[g]) {
      int32_t& entry = table[seq.live_from[g]];
      if (entry == kNullBlock) continue;
      pool_.release(entry);
      entry = kNullBlock;
    }
  }
}

void PagedBlockManager::resize_table(std::vector<int32_t>& table, int64_t size) {
  while (static_cast<int64_t>(table.size()) < size) table.push_back(pool_.take());
  // Blocks beyond the new reservation hold only rejected drafts: back to the pool.
  while (static_cast<int64_t>(table.size()) > size) {
    if (table.back() != kNullBlock) pool_.release(table.back());
    table.pop_back();
  }
}

bool PagedBlockManager::can_append_slots(int64_t seq_id, int64_t num_new_tokens,
                                         int64_t num_lookahead) const {
  const Sequence& seq = sequence(seq_id);
  if (num_new_tokens < 0) {
    throw std::invalid_argument("can_append_slots: num_new_tokens must be >= 0, got " +
                                std::to_string(num_new_tokens));
  }
  if (num_lookahead < 0) {
    throw std::invalid_argument("can_append_slots: num_lookahead must be >= 0, got " +
                                std::to_string(num_lookahead));
  }
  const int64_t writes = num_new_tokens + num_lookahead;
  if (writes == 0) return true;
  const int64_t end = static_cast<int64_t>(seq.tokens.size()) + writes;
  int64_t num_new = num_blocks_to_take(seq, end, end);
  for (int64_t g = 0; g < num_groups(); ++g) num_new += needs_copy_on_write(seq, g) ? 1 : 0;
  return num_new <= num_free_blocks();
}

std::vector<BlockCopy> PagedBlockManager::append_slots(int64_t seq_id,
                                                       const std::vector<int32_t>& new_tokens,
                                                       int64_t num_lookahead) {
  check_new_tokens(new_tokens);
  if (!can_append_slots(seq_id, static_cast<int64_t>(new_tokens.size()), num_lookahead)) {
    throw std::runtime_error("append_slots: not enough free KV cache blocks for " +
                             std::to_string(new_tokens.size()) + " more tokens and " +
                             std::to_string(num_lookahead) + " lookahead slots of sequence " +
                             std::to_string(seq_id));
  }
  Sequence& seq = sequence(seq_id);
  std::vector<BlockCopy> copies;
  if (!new_tokens.empty() || num_lookahead > 0) {
    drop_out_of_window(seq);
    for (int64_t g = 0; g < num_groups(); ++g) {
      if (!needs_copy_on_write(seq, g)) continue;
      // Another table still needs the old block's filled slots; ours gets a private copy.
      int32_t& last = seq.tables[g][seq.tokens.size() / block_size_];
      const int32_t copy = pool_.take();
      copies.push_back({last, copy});
      pool_.release(last);
      last = copy;
    }
  }
  seq.tokens.insert(seq.tokens.end(), new_tokens.begin(), new_tokens.end());
  seq.num_lookahead = num_lookahead;
  const int64_t end = static_cast<int64_t>(seq.tokens.size()) + num_lookahead;
  seq.sliding_end = end;
  for (std::vector<int32_t>& table : seq.tables) resize_table(table, blocks_for(end));
  return copies;
}

bool PagedBlockManager::can_reserve_prefill(int64_t seq_id, int64_t end) const {
  const Sequence& seq = sequence(seq_id);
  const int64_t num_tokens = static_cast<int64_t>(seq.tokens.size());
  if (end < 0 || end > num_tokens) {
    throw std::invalid_argument("reserve_prefill: end " + std::to_string(end) +
                                " is outside the sequence's " + std::to_string(num_tokens) +
                                " tokens");
  }
  const int64_t full_end = num_tokens + seq.num_lookahead;
  return num_blocks_to_take(seq, full_end, std::max(end, seq.sliding_end)) <= num_free_blocks();
}

void PagedBlockManager::reserve_prefill(int64_t seq_id, int64_t end) {
  if (!can_reserve_prefill(seq_id, end)) {
    throw std::runtime_error("reserve_prefill: not enough free KV cache blocks for sequence " +
                             std::to_string(seq_id) + " up to position " + std::to_string(end));
  }
  Sequence& seq = sequence(seq_id);
  drop_out_of_window(seq);
  seq.sliding_end = std::max(end, seq.sliding_end);
  // Full-attention tables hold every token's block already: only windows grow here.
  const int64_t full_end = static_cast<int64_t>(seq.tokens.size()) + seq.num_lookahead;
  for (int64_t g = 0; g < num_groups(); ++g) {
    resize_table(seq.tables[g], groups_[g].table_size(full_end, seq.sliding_end));
  }
}

void PagedBlockManager::mark_computed(int64_t seq_id, int64_t num_computed_tokens) {
  Sequence& seq = sequence(seq_id);
  const int64_t num_tokens = static_cast<int64_t>(seq.tokens.size());
  const bool any_sliding = std::any_of(groups_.begin(), groups_.end(),
                                       [](const BlockTablePolicy& g) { return g.sliding(); });
  if (num_computed_tokens < seq.num_computed || num_computed_tokens > num_tokens) {
    throw std::invalid_argument(
        "mark_computed: sequence " + std::to_string(seq_id) + " has " +
        std::to_string(seq.num_computed) + " of " + std::to_string(num_tokens) +
        " tokens computed; cannot set " + std::to_string(num_computed_tokens));
  }
  if (any_sliding && num_computed_tokens > seq.sliding_end) {
    throw std::invalid_argument("mark_computed: sequence " + std::to_string(seq_id) +
                                " has slots reserved up to position " +
                                std::to_string(seq.sliding_end) + "; cannot set " +
                                std::to_string(num_computed_tokens));
  }
  // Without sliding groups every token's block is held: the reservation follows the tokens.
  if (!any_sliding) seq.sliding_end = std::max(seq.sliding_end, num_computed_tokens);
  seq.num_computed = num_computed_tokens;
  if (!enable_prefix_caching_) return;
  for (; seq.num_hashed < num_computed_tokens / block_size_; ++seq.num_hashed) {
    const int64_t index = seq.num_hashed;
    const auto first = seq.tokens.begin() + index * block_size_;
    if (std::find(first, first + block_size_, kPendingToken) != first + block_size_) {
      throw std::logic_error("mark_computed: sequence " + std::to_string(seq_id) +
                             " has a block with a token still being sampled");
    }
    const uint64_t hash = hash_fn_(seq.chain_hash, seq.tokens.data() + index * block_size_,
                                   block_size_, seq.extra_key);
    for (int64_t g = 0; g < num_groups(); ++g) {
      if (groups_[g].chains_parents()) {
        cache_full_block(seq, g, index, hash);
      } else {
        cache_window_block(seq, g, index, hash);
      }
    }
    seq.chain_hash = hash;
  }
  if (num_state_snapshots_ > 0) ready_state_snapshot(seq_id, seq);
}

void PagedBlockManager::set_pending_token(int64_t seq_id, int32_t token) {
  Sequence& seq = sequence(seq_id);
  if (seq.tokens.empty() || seq.tokens.back() != kPendingToken || token < 0) {
    throw std::invalid_argument("set_pending_token: sequence " + std::to_string(seq_id) +
                                " has no pending last token, or the token " +
                                std::to_string(token) + " is negative");
  }
  seq.tokens.back() = token;
}

void PagedBlockManager::fork(int64_t parent_id, int64_t child_id) {
  const Sequence& parent = sequence(parent_id);
  if (has_sequence(child_id)) {
    throw std::invalid_argument("fork: sequence id " + std::to_string(child_id) +
                                " is already allocated");
  }
  if (parent.state_slot >= 0 && parent.reserved_states.empty() && free_states_.empty()) {
    throw std::runtime_error("fork: no state slot is free for sequence " +
                             std::to_string(child_id));
  }
  Sequence child = parent;
  child.reserved_states.clear();
  if (parent.state_slot >= 0) {
    Sequence& owner = sequence(parent_id);
    if (!owner.reserved_states.empty()) {
      child.state_slot = owner.reserved_states.back();
      owner.reserved_states.pop_back();
    } else {
      child.state_slot = take_free_state();
    }
    state_copies_.push_back({parent.state_slot, child.state_slot});
  }
  const int64_t num_tokens = static_cast<int64_t>(parent.tokens.size());
  child.num_lookahead = 0;
  child.sliding_end = std::min(parent.sliding_end, num_tokens);
  for (int64_t g = 0; g < num_groups(); ++g) {
    std::vector<int32_t>& table = child.tables[g];
    table.resize(std::min<int64_t>(table.size(),
                                   groups_[g].table_size(num_tokens, child.sliding_end)));
    for (int32_t b : table) {
      if (b != kNullBlock) pool_.acquire(b);
    }
  }
  sequences_.emplace(child_id, std::move(child));
}

void PagedBlockManager::free(int64_t seq_id) {
  const Sequence& seq = sequence(seq_id);
  // A snapshot planned and not ready was to be taken from this sequence's state: drop it.
  for (auto it = planned_snapshots_.begin(); it != planned_snapshots_.end();) {
    if (it->seq_id == seq_id && !it->ready) {
      free_snapshots_.push_back(it->slot);
      it = planned_snapshots_.erase(it);
    } else {
      ++it;
    }
  }
  // Last blocks first: they are the least likely to be shared, so they end up evicted first.
  for (const std::vector<int32_t>& table : seq.tables) {
    for (auto it = table.rbegin(); it != table.rend(); ++it) {
      if (*it != kNullBlock) pool_.release(*it);
    }
  }
  for (int32_t slot : seq.reserved_states) free_states_.push_back(slot);
  if (seq.state_slot >= 0) {
    free_states_.push_back(seq.state_slot);
    // A copy into the freed slot would overwrite whoever takes it next.
    state_copies_.erase(std::remove_if(state_copies_.begin(), state_copies_.end(),
                                       [&](const StateCopy& c) { return c.dst == seq.state_slot; }),
                        state_copies_.end());
  }
  sequences_.erase(seq_id);
}

int32_t PagedBlockManager::take_free_state() {
  const int32_t slot = free_states_.back();
  free_states_.pop_back();
  return slot;
}

void PagedBlockManager::discard_state_copies_to(int32_t slot) {
  if (slot < 0) return;
  state_copies_.erase(std::remove_if(state_copies_.begin(), state_copies_.end(),
                                     [slot](const StateCopy& c) { return c.dst == slot; }),
                      state_copies_.end());
}

std::vector<StateCopy> PagedBlockManager::take_state_copies() {
  std::vector<StateCopy> copies;
  copies.swap(state_copies_);
  return copies;
}

// ---------------------------------------------------------------------------------------------
// Blocks and the free queue

int64_t PagedBlockManager::num_free_among(const std::vector<int32_t>& block_ids) const {
  return std::count_if(block_ids.begin(), block_ids.end(),
                       [this](int32_t b) { return pool_.ref_count(b) == 0; });
}

}  // namespace kvserve
