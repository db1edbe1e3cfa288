// The PagedBlockManager's self-check (tests): tables, reference counts, the free queue and the
// prefix cache agree.
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/paged_block_manager_detail.h"
#include "kvserve/paged_block_manager.h"

namespace kvserve {

using namespace block_manager_detail;

namespace {

[[noreturn]] void fail(const std::string& message) {
  throw std::logic_error("PagedBlockManager invariant broken: " + message);
}

}  // namespace

void PagedBlockManager::check_invariants() const {
  std::vector<int64_t> table_refs(num_blocks(), 0);  // (sequence, position) entries per block
  for (const auto& [id, seq] : sequences_) {
    const std::string name = "sequence " + std::to_string(id);
    const int64_t num_tokens = static_cast<int64_t>(seq.tokens.size());
    const int64_t full_end = num_tokens + seq.num_lookahead;
    if (seq.num_lookahead < 0) fail(name + " has negative lookahead");
    if (seq.num_computed < 0 || seq.num_computed > num_tokens) fail(name + " computed count");
    if (seq.sliding_end < seq.num_computed || seq.sliding_end > full_end) {
      fail(name + " reserves its sliding groups to " + std::to_string(seq.sliding_end));
    }
    const int64_t num_hashed = enable_prefix_caching_ ? seq.num_computed / block_size_ : 0;
    // A state restored (restore_state) leaves the blocks hashed since: their K/V stays valid.
    const int64_t most_hashed = enable_prefix_caching_ && state_backups_
                                    ? num_tokens / block_size_ : num_hashed;
    if (seq.num_hashed < num_hashed || seq.num_hashed > most_hashed) {
      fail(name + " hashed " + std::to_string(seq.num_hashed));
    }
    if (static_cast<int64_t>(seq.tables.size()) != num_groups()) fail(name + " group count");
    for (int64_t g = 0; g < num_groups(); ++g) {
      const std::vector<int32_t>& table = seq.tables[g];
      const std::string where = name + " group " + std::to_string(g);
      const int64_t size = groups_[g].table_size(full_end, seq.sliding_end);
      if (static_cast<int64_t>(table.size()) != size) {
        fail(where + " has " + std::to_string(table.size()) + " blocks for " +
             std::to_string(num_tokens) + " tokens and " + std::to_string(seq.num_lookahead) +
             " lookahead slots");
      }
      // Null exactly before live_from, which the window has not passed.
      if (seq.live_from[g] < 0 ||
          seq.live_from[g] > groups_[g].first_visible_block(seq.num_computed)) {
        fail(where + " frees blocks its window still sees");
      }
      for (int64_t i = 0; i < size; ++i) {
        const int32_t b = table[i];
        if ((b == kNullBlock) != (i < seq.live_from[g])) {
          fail(where + " has block " + std::to_string(b) + " at " + std::to_string(i));
        }
        if (b == kNullBlock) continue;
        if (b < kNullBlock || b >= num_blocks()) fail(where + " holds block " + std::to_string(b));
        ++table_refs[b];
        if (pool_.is_cached(b) && pool_.content(b).group != g) {
          fail(where + " holds another group's");
        }
        // Blocks holding only lookahead slots are the sequence's own and never cached.
        if (i >= blocks_for(num_tokens) && (pool_.ref_count(b) != 1 || pool_.is_cached(b))) {
          fail(where + " shares or caches a lookahead block");
        }
      }
    }
  }
  pool_.check_invariants(table_refs);
  // The pool checks its own structure; the content of cached blocks is checked here, where the
  // hash and the groups are known.
  for (int32_t b = 1; b < num_blocks(); ++b) {
    if (!pool_.is_cached(b)) continue;
    const CachedBlock& block = pool_.content(b);
    const std::string name = "block " + std::to_string(b);
    if (block.key != group_key(block.hash, block.group)) {
      fail(name + " is cached under another key");
    }
    // Full-attention groups chain to a live parent block; sliding ones to their parent's hash.
    const bool chains = groups_[block.group].chains_parents();
    const bool chained = chains && pool_.is_live(block.parent);
    if (chained || !chains) {
      const uint64_t parent_hash = !chained ? block.parent_hash
                                   : block.parent.id == kNullBlock
                                       ? kRootHash
                                       : pool_.content(block.parent.id).hash;
      if (hash_fn_(parent_hash, block.tokens.data(), block_size_, block.extra_key) != block.hash) {
        fail(name + " is cached under a hash that its content does not give");
      }
    }
  }
  // State slots: each one free, held by one sequence, or kept by one for its forks.
  std::vector<int> holders(num_state_slots_, 0);
  const auto hold = [&](int32_t slot, const std::string& who) {
    if (slot < 0 || slot >= num_state_slots_) fail(who + " holds state slot " + std::to_string(slot));
    if (holders[slot]++) fail("state slot " + std::to_string(slot) + " is held twice");
  };
  for (int32_t slot : free_states_) hold(slot, "the free list");
  for (const auto& [id, seq] : sequences_) {
    const std::string name = "sequence " + std::to_string(id);
    if (num_state_slots_ == 0) {
      if (seq.state_slot != -1 || !seq.reserved_states.empty()) fail(name + " holds a state");
      continue;
    }
    hold(seq.state_slot, name);
    for (int32_t slot : seq.reserved_states) hold(slot, name);
  }
  for (int64_t slot = 0; slot < num_state_slots_; ++slot) {
    if (holders[slot] == 0) fail("state slot " + std::to_string(slot) + " is lost");
  }
  // Snapshot slots: each one free, planned for this step, or holding one snapshot (under its
  // hash).
  std::vector<int> snapshot_holders(num_state_snapshots_, 0);
  const auto keep = [&](int32_t slot, const std::string& who) {
    const int64_t i = slot - num_state_slots_;
    if (i < 0 || i >= num_state_snapshots_) {
      fail(who + " holds snapshot slot " + std::to_string(slot));
    }
    if (snapshot_holders[i]++) fail("snapshot slot " + std::to_string(slot) + " is held twice");
  };
  for (int32_t slot : free_snapshots_) keep(slot, "the free snapshot list");
  for (const PlannedSnapshot& p : planned_snapshots_) {
    keep(p.slot, "a planned snapshot");
    if (!has_sequence(p.seq_id) && !p.ready) fail("a planned snapshot's sequence is gone");
  }
  for (const auto& [hash, snapshot] : snapshots_) keep(snapshot.slot, "a snapshot");
  for (int64_t i = 0; i < num_state_snapshots_; ++i) {
    if (snapshot_holders[i] == 0) {
      fail("snapshot slot " + std::to_string(num_state_slots_ + i) + " is lost");
    }
  }
}

}  // namespace kvserve
