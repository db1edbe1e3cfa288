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
  std::vector<int64_t> table_refs(blocks_.size(), 0);  // (sequence, position) entries per block
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
    if (seq.num_hashed != num_hashed) fail(name + " hashed " + std::to_string(seq.num_hashed));
    if (static_cast<int64_t>(seq.tables.size()) != num_groups()) fail(name + " group count");
    for (int64_t g = 0; g < num_groups(); ++g) {
      const std::vector<int32_t>& table = seq.tables[g];
      const std::string where = name + " group " + std::to_string(g);
      const int64_t size = blocks_for(sliding(g) ? seq.sliding_end : full_end);
      if (static_cast<int64_t>(table.size()) != size) {
        fail(where + " has " + std::to_string(table.size()) + " blocks for " +
             std::to_string(num_tokens) + " tokens and " + std::to_string(seq.num_lookahead) +
             " lookahead slots");
      }
      // Null exactly before live_from, which the window has not passed.
      if (seq.live_from[g] < 0 || seq.live_from[g] > window_first_block(g, seq.num_computed)) {
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
        if (blocks_[b].cached && blocks_[b].group != g) fail(where + " holds another group's");
        // Blocks holding only lookahead slots are the sequence's own and never cached.
        if (i >= blocks_for(num_tokens) && (blocks_[b].ref_count != 1 || blocks_[b].cached)) {
          fail(where + " shares or caches a lookahead block");
        }
      }
    }
  }
  check_block_invariants(table_refs);
}

void PagedBlockManager::check_block_invariants(const std::vector<int64_t>& table_refs) const {
  const std::vector<int32_t> queue = free_queue_.to_vector();
  if (static_cast<int64_t>(queue.size()) != free_queue_.size()) fail("free queue size");
  std::vector<bool> queued(blocks_.size(), false);
  bool cached_seen = false;
  auto name = [](int32_t b) { return "block " + std::to_string(b); };
  for (int32_t b : queue) {
    if (b <= kNullBlock || b >= num_blocks()) fail(name(b) + " in the free queue");
    if (queued[b] || !free_queue_.contains(b)) fail(name(b) + " queued twice or not flagged");
    queued[b] = true;
    cached_seen |= blocks_[b].cached;
    if (cached_seen && !blocks_[b].cached) fail(name(b) + " is uncached behind a cached one");
  }
  const Block& null_block = blocks_[kNullBlock];
  if (null_block.ref_count != 0 || null_block.cached || null_block.generation != 0 ||
      table_refs[kNullBlock] != 0 || free_queue_.contains(kNullBlock)) {
    fail("the null block was used");
  }
  int64_t num_used = 0;
  for (int32_t b = 1; b < num_blocks(); ++b) {
    const Block& block = blocks_[b];
    if (block.ref_count != table_refs[b]) {
      fail(name(b) + " has ref_count " + std::to_string(block.ref_count) + " but " +
           std::to_string(table_refs[b]) + " table entries");
    }
    if (queued[b] == (block.ref_count > 0)) fail(name(b) + " is both free and used, or neither");
    num_used += block.ref_count > 0;
    if (!block.cached) continue;
    const auto it = cached_.find(block.key);
    if (it == cached_.end() || it->second != b || block.key != group_key(block.hash, block.group)) {
      fail(name(b) + " is cached but not mapped");
    }
    // Full-attention groups chain to a live parent block; sliding ones to their parent's hash.
    const bool chained = !sliding(block.group) && is_live(block.parent);
    if (chained || sliding(block.group)) {
      const uint64_t parent_hash =
          !chained ? block.parent_hash
                   : block.parent.id == kNullBlock ? kRootHash : blocks_[block.parent.id].hash;
      if (hash_fn_(parent_hash, block.tokens.data(), block_size_, block.extra_key) != block.hash) {
        fail(name(b) + " is cached under a hash that its content does not give");
      }
    }
  }
  if (num_used + static_cast<int64_t>(queue.size()) != num_usable_blocks()) fail("block count");
  for (const auto& [key, b] : cached_) {
    if (!blocks_[b].cached || blocks_[b].key != key) fail("stale hash map entry");
  }
}

}  // namespace kvserve
