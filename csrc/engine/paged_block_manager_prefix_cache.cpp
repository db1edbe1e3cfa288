// The PagedBlockManager's prefix cache: matching a prompt's cached prefix in every group of
// layers, and caching each group's blocks as their KV is computed.
#include <algorithm>

#include "engine/paged_block_manager_detail.h"
#include "kvserve/paged_block_manager.h"

namespace kvserve {

using namespace block_manager_detail;

uint64_t PagedBlockManager::group_key(uint64_t hash, int64_t group) const {
  // Group 0 keys blocks by their plain hash; the others by one salted with the group.
  return group == 0 ? hash : combine(hash, 0x67726f7570000000ULL + static_cast<uint64_t>(group));
}

void PagedBlockManager::extend_hashes(const std::vector<int32_t>& tokens, uint64_t extra_key,
                                      std::vector<uint64_t>& hashes, int64_t count) const {
  while (static_cast<int64_t>(hashes.size()) < count) {
    const int64_t i = static_cast<int64_t>(hashes.size());
    hashes.push_back(hash_fn_(i == 0 ? kRootHash : hashes.back(),
                              tokens.data() + i * block_size_, block_size_, extra_key));
  }
}

PagedBlockManager::PrefixMatch PagedBlockManager::match_prefix(const std::vector<int32_t>& tokens,
                                                               uint64_t extra_key) const {
  PrefixMatch match;
  match.blocks.resize(num_groups());
  match.first.assign(num_groups(), 0);
  match.last_hash = kRootHash;
  if (!enable_prefix_caching_) return match;
  // Only full blocks within the first len-1 tokens: the last token is computed for its logits.
  int64_t num = (static_cast<int64_t>(tokens.size()) - 1) / block_size_;
  std::vector<uint64_t> hashes;
  for (int64_t g = 0; g < num_groups() && num > 0; ++g) {
    if (!groups_[g].chains_parents()) continue;
    match_full_group(tokens, extra_key, g, num, hashes, match.blocks[g]);
    num = static_cast<int64_t>(match.blocks[g].size());
  }
  match.num_shared_blocks = num;
  // The longest prefix whose window every sliding group still holds (and, with a state pool,
  // whose last block has a snapshot of the state there).
  for (;; --num) {
    bool all = num_state_snapshots_ == 0 || num == 0 ||
               snapshot_at(hashes[num - 1], match.blocks[0][num - 1]) != nullptr;
    for (int64_t g = 0; g < num_groups() && all; ++g) {
      if (!groups_[g].chains_parents())
        all = match_window(tokens, extra_key, g, num, hashes, match.blocks[g]);
    }
    if (all || num == 0) break;
  }
  match.num_blocks = num;
  for (int64_t g = 0; g < num_groups(); ++g) {
    if (!groups_[g].chains_parents()) {
      match.first[g] = groups_[g].first_visible_block(num * block_size_);
    } else {
      match.blocks[g].resize(num);
    }
  }
  match.last_hash = num > 0 ? hashes[num - 1] : kRootHash;
  if (num > 0 && num_state_snapshots_ > 0) {
    match.state_source = snapshot_at(match.last_hash, match.blocks[0][num - 1])->slot;
  }
  return match;
}

void PagedBlockManager::match_full_group(const std::vector<int32_t>& tokens, uint64_t extra_key,
                                         int64_t group, int64_t limit,
                                         std::vector<uint64_t>& hashes,
                                         std::vector<int32_t>& hits) const {
  BlockRef parent{kNullBlock, 0};
  for (int64_t i = 0; i < limit; ++i) {
    extend_hashes(tokens, extra_key, hashes, i + 1);
    const int32_t* block_tokens = tokens.data() + i * block_size_;
    const int32_t block = pool_.find(group_key(hashes[i], group));
    if (block < 0 || !holds(block, block_tokens, extra_key, parent)) break;
    hits.push_back(block);
    parent = pool_.ref(block);
  }
}

// A sliding group's early blocks may be gone (freed out of its window and evicted), so its window
// blocks are checked against their tokens and their parent's chained hash instead of a chain of
// live parents.
bool PagedBlockManager::match_window(const std::vector<int32_t>& tokens, uint64_t extra_key,
                                     int64_t group, int64_t num_blocks,
                                     std::vector<uint64_t>& hashes,
                                     std::vector<int32_t>& hits) const {
  hits.clear();
  extend_hashes(tokens, extra_key, hashes, num_blocks);
  const int64_t first = groups_[group].first_visible_block(num_blocks * block_size_);
  for (int64_t i = first; i < num_blocks; ++i) {
    const int32_t id = pool_.find(group_key(hashes[i], group));
    if (id < 0) return false;
    const CachedBlock& block = pool_.content(id);
    const int32_t* block_tokens = tokens.data() + i * block_size_;
    if (block.extra_key != extra_key || block.parent_hash != (i == 0 ? kRootHash : hashes[i - 1]) ||
        !std::equal(block.tokens.begin(), block.tokens.end(), block_tokens)) {
      return false;
    }
    hits.push_back(id);
  }
  return true;
}

// A hash match is a hit only if the content matches too, and the parent is the very block (same
// id, same allocation) that the previous position matched: a hash collision cannot serve wrong KV.
bool PagedBlockManager::holds(int32_t block_id, const int32_t* tokens, uint64_t extra_key,
                              BlockRef parent) const {
  const CachedBlock& block = pool_.content(block_id);
  return block.extra_key == extra_key && block.parent == parent &&
         std::equal(block.tokens.begin(), block.tokens.end(), tokens);
}

void PagedBlockManager::cache_full_block(Sequence& seq, int64_t group, int64_t index,
                                         uint64_t hash) {
  BlockRef& chain_ref = seq.chain_refs[group];
  if (!pool_.is_live(chain_ref)) {  // a block before this one is not cached: nothing can reach it
    chain_ref = {kBrokenChain, 0};
    return;
  }
  const int32_t* tokens = seq.tokens.data() + index * block_size_;
  const int32_t own = seq.tables[group][index];
  const int32_t other = pool_.find(group_key(hash, group));
  if (other >= 0 && other != own) {
    if (holds(other, tokens, seq.extra_key, chain_ref)) {  // same content: keep one copy
      chain_ref = pool_.ref(other);
      return;
    }
    if (pool_.is_live(pool_.content(other).parent)) {  // a true collision: the first keeps it
      chain_ref = {kBrokenChain, 0};
      return;
    }
    pool_.uncache(other);  // its parent was evicted, so no prefix reaches it any more
  }
  if (!pool_.is_cached(own)) {
    cache(own, group, hash, tokens, seq.extra_key, chain_ref, seq.chain_hash);
  }
  chain_ref = pool_.ref(own);
}

void PagedBlockManager::cache_window_block(Sequence& seq, int64_t group, int64_t index,
                                           uint64_t hash) {
  const int32_t own = seq.tables[group][index];
  if (own == kNullBlock || pool_.is_cached(own)) return;
  // Taken by another block: the same content (keep one copy) or a collision (the first keeps it).
  if (pool_.find(group_key(hash, group)) >= 0) return;
  cache(own, group, hash, seq.tokens.data() + index * block_size_, seq.extra_key,
        BlockRef{kNullBlock, 0}, seq.chain_hash);
}

void PagedBlockManager::cache(int32_t block_id, int64_t group, uint64_t hash,
                              const int32_t* tokens, uint64_t extra_key, BlockRef parent,
                              uint64_t parent_hash) {
  pool_.cache(block_id, {.hash = hash,
                         .key = group_key(hash, group),
                         .group = group,
                         .parent_hash = parent_hash,
                         .extra_key = extra_key,
                         .parent = parent,
                         .tokens = std::vector<int32_t>(tokens, tokens + block_size_)});
}

void PagedBlockManager::reset_prefix_cache() { pool_.reset_prefix_cache(); }

}  // namespace kvserve
