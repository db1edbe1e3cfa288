#include "kvserve/block_pool.h"

#include <limits>
#include <stdexcept>
#include <string>

#include "engine/paged_block_manager_detail.h"

namespace kvserve {

using namespace block_manager_detail;

namespace {

int64_t checked_num_blocks(int64_t num_blocks) {
  if (num_blocks < 2 || num_blocks >= std::numeric_limits<int32_t>::max()) {
    throw std::invalid_argument(
        "PagedBlockManager: num_blocks must be in [2, 2^31 - 1) (block 0 is the null block), "
        "got " + std::to_string(num_blocks));
  }
  return num_blocks;
}

[[noreturn]] void broken(const std::string& message) {
  throw std::logic_error("BlockPool invariant broken: " + message);
}

}  // namespace

// --------------------------------------------------------------------------------- free queue

BlockPool::FreeBlockQueue::FreeBlockQueue(int32_t num_blocks)
    : sentinel_(num_blocks),
      prev_(num_blocks + 1, num_blocks),
      next_(num_blocks + 1, num_blocks),
      contains_(num_blocks, false) {}

void BlockPool::FreeBlockQueue::insert_before(int32_t position, int32_t block_id) {
  const int32_t before = prev_[position];
  next_[before] = block_id;
  prev_[block_id] = before;
  next_[block_id] = position;
  prev_[position] = block_id;
  contains_[block_id] = true;
  ++size_;
}

void BlockPool::FreeBlockQueue::remove(int32_t block_id) {
  next_[prev_[block_id]] = next_[block_id];
  prev_[next_[block_id]] = prev_[block_id];
  contains_[block_id] = false;
  --size_;
}

int32_t BlockPool::FreeBlockQueue::pop_front() {
  if (size_ == 0) throw std::logic_error("BlockPool: no free block to hand out");
  const int32_t head = next_[sentinel_];
  remove(head);
  return head;
}

std::vector<int32_t> BlockPool::FreeBlockQueue::to_vector() const {
  std::vector<int32_t> ids;
  for (int32_t b = next_[sentinel_]; b != sentinel_; b = next_[b]) {
    if (static_cast<int64_t>(ids.size()) > size_ || prev_[next_[b]] != b) {
      throw std::logic_error("free queue links are corrupt");
    }
    ids.push_back(b);
  }
  return ids;
}

// ------------------------------------------------------------------------------------- blocks

BlockPool::BlockPool(int64_t num_blocks)
    : blocks_(checked_num_blocks(num_blocks)), free_queue_(static_cast<int32_t>(num_blocks)) {
  for (int32_t b = 1; b < num_blocks; ++b) free_queue_.push_back(b);
}

int32_t BlockPool::take() {
  const int32_t b = free_queue_.pop_front();
  if (blocks_[b].cached) {
    uncache(b);
    ++num_evictions_;
  }
  ++blocks_[b].generation;
  blocks_[b].ref_count = 1;
  return b;
}

void BlockPool::acquire(int32_t block_id) {
  if (blocks_[block_id].ref_count++ == 0) free_queue_.remove(block_id);
}

void BlockPool::release(int32_t block_id) {
  Block& block = blocks_[block_id];
  if (--block.ref_count > 0) return;
  // Uncached blocks hold nothing reusable: hand them out before any cached block.
  if (block.cached) {
    free_queue_.push_back(block_id);
  } else {
    free_queue_.push_front(block_id);
  }
}

int32_t BlockPool::ref_count(int32_t block_id) const {
  if (block_id < 0 || block_id >= num_blocks()) {
    throw std::out_of_range("PagedBlockManager: block id " + std::to_string(block_id) +
                            " is outside [0, " + std::to_string(num_blocks()) + ")");
  }
  return blocks_[block_id].ref_count;
}

double BlockPool::usage() const {
  return static_cast<double>(num_usable_blocks() - num_free_blocks()) /
         static_cast<double>(num_usable_blocks());
}

// ------------------------------------------------------------------------------- prefix cache

int32_t BlockPool::find(uint64_t key) const {
  const auto it = cached_.find(key);
  return it == cached_.end() ? -1 : it->second;
}

void BlockPool::cache(int32_t block_id, CachedBlock content) {
  Block& block = blocks_[block_id];
  cached_.emplace(content.key, block_id);
  block.cached = true;
  block.content = std::move(content);
}

void BlockPool::uncache(int32_t block_id) {
  Block& block = blocks_[block_id];
  cached_.erase(block.content.key);
  block.cached = false;
  block.content.tokens.clear();
  if (free_queue_.contains(block_id)) {  // now worthless: reuse it before any cached block
    free_queue_.remove(block_id);
    free_queue_.push_front(block_id);
  }
}

void BlockPool::reset_prefix_cache() {
  for (int32_t b : free_queue_.to_vector()) {
    if (blocks_[b].cached) uncache(b);
  }
}

bool BlockPool::is_live(BlockRef ref) const {
  if (ref.id == kNullBlock) return true;
  if (ref.id < 0) return false;
  const Block& block = blocks_[ref.id];
  return block.cached && block.generation == ref.generation;
}

// --------------------------------------------------------------------------------- invariants

void BlockPool::check_invariants(const std::vector<int64_t>& table_refs) const {
  const std::vector<int32_t> queue = free_queue_.to_vector();
  if (static_cast<int64_t>(queue.size()) != free_queue_.size()) broken("free queue size");
  std::vector<bool> queued(blocks_.size(), false);
  bool cached_seen = false;
  auto name = [](int32_t b) { return "block " + std::to_string(b); };
  for (int32_t b : queue) {
    if (b <= kNullBlock || b >= num_blocks()) broken(name(b) + " in the free queue");
    if (queued[b] || !free_queue_.contains(b)) broken(name(b) + " queued twice or not flagged");
    queued[b] = true;
    cached_seen |= blocks_[b].cached;
    if (cached_seen && !blocks_[b].cached) broken(name(b) + " is uncached behind a cached one");
  }
  const Block& null_block = blocks_[kNullBlock];
  if (null_block.ref_count != 0 || null_block.cached || null_block.generation != 0 ||
      table_refs[kNullBlock] != 0 || free_queue_.contains(kNullBlock)) {
    broken("the null block was used");
  }
  int64_t num_used = 0;
  for (int32_t b = 1; b < num_blocks(); ++b) {
    const Block& block = blocks_[b];
    if (block.ref_count != table_refs[b]) {
      broken(name(b) + " has ref_count " + std::to_string(block.ref_count) + " but " +
             std::to_string(table_refs[b]) + " table entries");
    }
    if (queued[b] == (block.ref_count > 0)) broken(name(b) + " is both free and used, or neither");
    num_used += block.ref_count > 0;
    if (block.cached && find(block.content.key) != b) broken(name(b) + " is cached but not mapped");
  }
  if (num_used + static_cast<int64_t>(queue.size()) != num_usable_blocks()) broken("block count");
  for (const auto& [key, b] : cached_) {
    if (!blocks_[b].cached || blocks_[b].content.key != key) broken("stale hash map entry");
  }
}

}  // namespace kvserve
