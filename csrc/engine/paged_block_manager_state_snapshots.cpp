// The PagedBlockManager's state snapshots: for a model with state-space layers, the state of a
// sequence saved at a block boundary, so that a prefix hit ending at that block can start from
// it (vLLM's "align" mode of Mamba prefix caching). A snapshot is planned when a step's
// computed tokens end at a boundary (the scheduler aligns prefill chunks to boundaries), its copy
// done after the step's forward, and it serves hits only once the step is committed: a sequence
// admitted in the same step must not read a state not yet written.
#include <algorithm>
#include <limits>

#include "engine/paged_block_manager_detail.h"
#include "kvserve/paged_block_manager.h"

namespace kvserve {

using namespace block_manager_detail;

const PagedBlockManager::StateSnapshot* PagedBlockManager::snapshot_at(uint64_t hash,
                                                                       int32_t block_id) const {
  const auto it = snapshots_.find(hash);
  // The snapshot is the state after the very block the match verified (same id, same
  // allocation): a hash that collides, or a block reused since, never serves another's state.
  if (it == snapshots_.end() || !(it->second.block == pool_.ref(block_id)) ||
      !pool_.is_live(it->second.block)) {
    return nullptr;
  }
  return &it->second;
}

int32_t PagedBlockManager::take_snapshot_slot() {
  if (free_snapshots_.empty()) {
    // Snapshots whose block left the prefix cache can serve no hit: reclaim them all.
    for (auto it = snapshots_.begin(); it != snapshots_.end();) {
      if (pool_.is_live(it->second.block)) {
        ++it;
        continue;
      }
      free_snapshots_.push_back(it->second.slot);
      it = snapshots_.erase(it);
    }
  }
  if (free_snapshots_.empty()) {  // else the least recently used one
    auto oldest = snapshots_.end();
    for (auto it = snapshots_.begin(); it != snapshots_.end(); ++it) {
      if (oldest == snapshots_.end() || it->second.last_used < oldest->second.last_used) {
        oldest = it;
      }
    }
    if (oldest == snapshots_.end()) return -1;
    free_snapshots_.push_back(oldest->second.slot);
    snapshots_.erase(oldest);
  }
  const int32_t slot = free_snapshots_.back();
  free_snapshots_.pop_back();
  return slot;
}

std::optional<StateCopy> PagedBlockManager::snapshot_state(int64_t seq_id, int64_t end) {
  const Sequence& seq = sequence(seq_id);
  if (num_state_snapshots_ == 0 || end <= 0 || end % block_size_ != 0 ||
      end > static_cast<int64_t>(seq.tokens.size())) {
    return std::nullopt;
  }
  // A block after a break in the sequence's chain never enters the prefix cache.
  if (!pool_.is_live(seq.chain_refs[0]) && seq.num_hashed > 0) return std::nullopt;
  for (const PlannedSnapshot& p : planned_snapshots_) {
    if (p.seq_id == seq_id) return std::nullopt;  // one a step
  }
  const int32_t slot = take_snapshot_slot();
  if (slot < 0) return std::nullopt;
  planned_snapshots_.push_back({.seq_id = seq_id, .end = end, .slot = slot});
  // A newly admitted sequence is marked computed at admission: its block may be cached already.
  ready_state_snapshot(seq_id, seq);
  return StateCopy{seq.state_slot, slot};
}

void PagedBlockManager::ready_state_snapshot(int64_t seq_id, const Sequence& seq) {
  for (PlannedSnapshot& p : planned_snapshots_) {
    if (p.seq_id != seq_id || p.ready || seq.num_hashed * block_size_ != p.end) continue;
    // The chain's last block is the one at the boundary: its own block, or the cached copy of
    // the same content it was folded into.
    if (pool_.is_live(seq.chain_refs[0]) && seq.chain_refs[0].id != kNullBlock) {
      p.ready = true;
      p.hash = seq.chain_hash;
      p.block = seq.chain_refs[0];
    }
  }
}

int64_t PagedBlockManager::snapshot_boundary(int64_t seq_id) const {
  const Sequence& seq = sequence(seq_id);
  return seq.snapshot_end > seq.num_computed ? seq.snapshot_end : 0;
}

void PagedBlockManager::commit_state_snapshots() {
  for (const PlannedSnapshot& p : planned_snapshots_) {
    const auto it = snapshots_.find(p.hash);
    const bool taken = it != snapshots_.end() && pool_.is_live(it->second.block);
    if (!p.ready || !pool_.is_live(p.block) || taken) {
      free_snapshots_.push_back(p.slot);
      continue;
    }
    if (it != snapshots_.end()) {  // a stale one under the same hash
      free_snapshots_.push_back(it->second.slot);
      snapshots_.erase(it);
    }
    snapshots_.emplace(p.hash, StateSnapshot{p.slot, p.block, ++snapshot_clock_});
  }
  planned_snapshots_.clear();
}

void PagedBlockManager::discard_state_snapshots() {
  for (const PlannedSnapshot& p : planned_snapshots_) free_snapshots_.push_back(p.slot);
  planned_snapshots_.clear();
}

}  // namespace kvserve
