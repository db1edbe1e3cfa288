#include "kvserve/paged_block_manager.h"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>

namespace kvserve {
namespace {

constexpr int32_t kNullBlock = 0;
constexpr int32_t kBrokenChain = -1;  // BlockRef id of a chain whose next blocks are not cached
constexpr uint64_t kRootHash = 0x6b76736572766531ULL;  // parent hash of every first block

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Order-sensitive: the running hash is re-mixed after each value.
uint64_t combine(uint64_t hash, uint64_t value) { return splitmix64(hash ^ splitmix64(value)); }

void check_tokens(const std::vector<int32_t>& tokens, const char* what) {
  for (int32_t token : tokens) {
    if (token < 0) {
      throw std::invalid_argument(std::string(what) + ": token ids must be non-negative, got " +
                                  std::to_string(token));
    }
  }
}

int64_t checked_num_blocks(int64_t num_blocks) {
  if (num_blocks < 2 || num_blocks >= std::numeric_limits<int32_t>::max()) {
    throw std::invalid_argument("PagedBlockManager: num_blocks must be in [2, 2^31 - 1) (block 0 "
                                "is the null block), got " + std::to_string(num_blocks));
  }
  return num_blocks;
}

void check_prompt(const std::vector<int32_t>& prompt_tokens, const char* what) {
  if (prompt_tokens.empty()) throw std::invalid_argument(std::string(what) + ": empty prompt");
  check_tokens(prompt_tokens, what);
}

}  // namespace

PagedBlockManager::FreeBlockQueue::FreeBlockQueue(int32_t num_blocks)
    : sentinel_(num_blocks),
      prev_(num_blocks + 1, num_blocks),
      next_(num_blocks + 1, num_blocks),
      contains_(num_blocks, false) {}

void PagedBlockManager::FreeBlockQueue::insert_before(int32_t position, int32_t block_id) {
  const int32_t before = prev_[position];
  next_[before] = block_id;
  prev_[block_id] = before;
  next_[block_id] = position;
  prev_[position] = block_id;
  contains_[block_id] = true;
  ++size_;
}

void PagedBlockManager::FreeBlockQueue::remove(int32_t block_id) {
  next_[prev_[block_id]] = next_[block_id];
  prev_[next_[block_id]] = prev_[block_id];
  contains_[block_id] = false;
  --size_;
}

int32_t PagedBlockManager::FreeBlockQueue::pop_front() {
  const int32_t head = next_[sentinel_];
  remove(head);
  return head;
}

std::vector<int32_t> PagedBlockManager::FreeBlockQueue::to_vector() const {
  std::vector<int32_t> ids;
  for (int32_t b = next_[sentinel_]; b != sentinel_; b = next_[b]) {
    if (static_cast<int64_t>(ids.size()) > size_ || prev_[next_[b]] != b) {
      throw std::logic_error("free queue links are corrupt");
    }
    ids.push_back(b);
  }
  return ids;
}

PagedBlockManager::PagedBlockManager(int64_t num_blocks, int64_t block_size,
                                     bool enable_prefix_caching, double watermark,
                                     BlockHashFn hash_fn)
    : block_size_(block_size),
      enable_prefix_caching_(enable_prefix_caching),
      hash_fn_(hash_fn ? std::move(hash_fn) : BlockHashFn(&default_block_hash)),
      blocks_(checked_num_blocks(num_blocks)),
      free_queue_(static_cast<int32_t>(num_blocks)) {
  if (block_size < 1) {
    throw std::invalid_argument("PagedBlockManager: block_size must be >= 1, got " +
                                std::to_string(block_size));
  }
  if (!(watermark >= 0.0 && watermark < 1.0)) {
    throw std::invalid_argument("PagedBlockManager: watermark must be in [0, 1), got " +
                                std::to_string(watermark));
  }
  // Rounded down, as vLLM does: a tiny pool keeps no watermark.
  watermark_blocks_ = static_cast<int64_t>(watermark * static_cast<double>(num_blocks - 1));
  for (int32_t b = 1; b < num_blocks; ++b) free_queue_.push_back(b);
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

bool PagedBlockManager::can_allocate(const std::vector<int32_t>& prompt_tokens,
                                     uint64_t extra_key) const {
  check_prompt(prompt_tokens, "can_allocate");
  const PrefixMatch match = match_prefix(prompt_tokens, extra_key);
  const int64_t num_new = blocks_for(static_cast<int64_t>(prompt_tokens.size())) -
                          static_cast<int64_t>(match.blocks.size());
  const int64_t num_taken = num_new + num_free_among(match.blocks);
  return num_free_blocks() - num_taken >= watermark_blocks_;
}

int64_t PagedBlockManager::allocate(int64_t seq_id, const std::vector<int32_t>& prompt_tokens,
                                    uint64_t extra_key) {
  check_prompt(prompt_tokens, "allocate");
  if (has_sequence(seq_id)) {
    throw std::invalid_argument("allocate: sequence id " + std::to_string(seq_id) +
                                " is already allocated");
  }
  const int64_t num_prompt = static_cast<int64_t>(prompt_tokens.size());
  const PrefixMatch match = match_prefix(prompt_tokens, extra_key);
  const int64_t num_hit_blocks = static_cast<int64_t>(match.blocks.size());
  const int64_t num_new = blocks_for(num_prompt) - num_hit_blocks;
  const int64_t num_taken = num_new + num_free_among(match.blocks);
  if (num_taken > num_free_blocks()) {
    throw std::runtime_error("allocate: sequence " + std::to_string(seq_id) + " needs " +
                             std::to_string(num_taken) + " free KV cache blocks (" +
                             std::to_string(num_free_blocks()) + " free)");
  }
  Sequence seq;
  seq.tokens = prompt_tokens;
  seq.extra_key = extra_key;
  // Take the hits out of the free queue before new blocks are popped, which may evict.
  for (int32_t b : match.blocks) {
    acquire(b);
    seq.block_table.push_back(b);
  }
  for (int64_t i = 0; i < num_new; ++i) seq.block_table.push_back(take_free_block());
  seq.num_computed = num_hit_blocks * block_size_;
  seq.num_hashed = num_hit_blocks;
  seq.chain_hash = match.last_hash;
  seq.chain_ref = match.blocks.empty() ? BlockRef{kNullBlock, 0} : ref(match.blocks.back());
  if (enable_prefix_caching_) {
    prefix_cache_queries_ += num_prompt;
    prefix_cache_hits_ += seq.num_computed;
  }
  sequences_.emplace(seq_id, std::move(seq));
  return num_hit_blocks * block_size_;
}

// The next write lands in the last token's block; a shared one must be copied first.
bool PagedBlockManager::needs_copy_on_write(const Sequence& seq) const {
  const int64_t num_tokens = static_cast<int64_t>(seq.tokens.size());
  const bool partial = num_tokens % block_size_ != 0;
  return partial && blocks_[seq.block_table[num_tokens / block_size_]].ref_count > 1;
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
  const int64_t num_new = blocks_for(static_cast<int64_t>(seq.tokens.size()) + writes) -
                          static_cast<int64_t>(seq.block_table.size()) +
                          (needs_copy_on_write(seq) ? 1 : 0);
  return num_new <= num_free_blocks();
}

std::vector<BlockCopy> PagedBlockManager::append_slots(int64_t seq_id,
                                                       const std::vector<int32_t>& new_tokens,
                                                       int64_t num_lookahead) {
  check_tokens(new_tokens, "append_slots");
  if (!can_append_slots(seq_id, static_cast<int64_t>(new_tokens.size()), num_lookahead)) {
    throw std::runtime_error("append_slots: not enough free KV cache blocks for " +
                             std::to_string(new_tokens.size()) + " more tokens and " +
                             std::to_string(num_lookahead) + " lookahead slots of sequence " +
                             std::to_string(seq_id));
  }
  Sequence& seq = sequence(seq_id);
  std::vector<BlockCopy> copies;
  if (!new_tokens.empty() || num_lookahead > 0) {
    if (needs_copy_on_write(seq)) {
      // Another table still needs the old block's filled slots; ours gets a private copy.
      int32_t& last = seq.block_table[seq.tokens.size() / block_size_];
      const int32_t copy = take_free_block();
      copies.push_back({last, copy});
      release(last);
      last = copy;
    }
  }
  seq.tokens.insert(seq.tokens.end(), new_tokens.begin(), new_tokens.end());
  seq.num_lookahead = num_lookahead;
  const int64_t reserved = blocks_for(static_cast<int64_t>(seq.tokens.size()) + num_lookahead);
  while (static_cast<int64_t>(seq.block_table.size()) < reserved) {
    seq.block_table.push_back(take_free_block());
  }
  // Lookahead blocks beyond the new reservation hold only rejected drafts: back to the pool.
  while (static_cast<int64_t>(seq.block_table.size()) > reserved) {
    release(seq.block_table.back());
    seq.block_table.pop_back();
  }
  return copies;
}

void PagedBlockManager::mark_computed(int64_t seq_id, int64_t num_computed_tokens) {
  Sequence& seq = sequence(seq_id);
  const int64_t num_tokens = static_cast<int64_t>(seq.tokens.size());
  if (num_computed_tokens < seq.num_computed || num_computed_tokens > num_tokens) {
    throw std::invalid_argument(
        "mark_computed: sequence " + std::to_string(seq_id) + " has " +
        std::to_string(seq.num_computed) + " of " + std::to_string(num_tokens) +
        " tokens computed; cannot set " + std::to_string(num_computed_tokens));
  }
  seq.num_computed = num_computed_tokens;
  if (!enable_prefix_caching_) return;
  for (; seq.num_hashed < num_computed_tokens / block_size_; ++seq.num_hashed) {
    cache_full_block(seq, seq.num_hashed);
  }
}

void PagedBlockManager::fork(int64_t parent_id, int64_t child_id) {
  const Sequence& parent = sequence(parent_id);
  if (has_sequence(child_id)) {
    throw std::invalid_argument("fork: sequence id " + std::to_string(child_id) +
                                " is already allocated");
  }
  Sequence child = parent;
  child.block_table.resize(blocks_for(static_cast<int64_t>(parent.tokens.size())));
  child.num_lookahead = 0;
  for (int32_t b : child.block_table) ++blocks_[b].ref_count;
  sequences_.emplace(child_id, std::move(child));
}

void PagedBlockManager::free(int64_t seq_id) {
  const Sequence& seq = sequence(seq_id);
  // Last blocks first: they are the least likely to be shared, so they end up evicted first.
  for (auto it = seq.block_table.rbegin(); it != seq.block_table.rend(); ++it) release(*it);
  sequences_.erase(seq_id);
}

// ---------------------------------------------------------------------------------------------
// Blocks and the free queue

int64_t PagedBlockManager::num_free_among(const std::vector<int32_t>& block_ids) const {
  return std::count_if(block_ids.begin(), block_ids.end(),
                       [this](int32_t b) { return blocks_[b].ref_count == 0; });
}

int32_t PagedBlockManager::take_free_block() {
  const int32_t b = free_queue_.pop_front();
  if (blocks_[b].cached) {
    uncache(b);
    ++num_evictions_;
  }
  ++blocks_[b].generation;
  blocks_[b].ref_count = 1;
  return b;
}

void PagedBlockManager::acquire(int32_t block_id) {
  if (blocks_[block_id].ref_count++ == 0) free_queue_.remove(block_id);
}

void PagedBlockManager::release(int32_t block_id) {
  Block& block = blocks_[block_id];
  if (--block.ref_count > 0) return;
  // Uncached blocks hold nothing reusable: hand them out before any cached block.
  if (block.cached) {
    free_queue_.push_back(block_id);
  } else {
    free_queue_.push_front(block_id);
  }
}

double PagedBlockManager::usage() const {
  return static_cast<double>(num_usable_blocks() - num_free_blocks()) /
         static_cast<double>(num_usable_blocks());
}

std::vector<int32_t> PagedBlockManager::free_block_ids() const { return free_queue_.to_vector(); }

int32_t PagedBlockManager::ref_count(int32_t block_id) const {
  if (block_id < 0 || block_id >= num_blocks()) {
    throw std::out_of_range("PagedBlockManager: block id " + std::to_string(block_id) +
                            " is outside [0, " + std::to_string(num_blocks()) + ")");
  }
  return blocks_[block_id].ref_count;
}

// ---------------------------------------------------------------------------------------------
// Prefix cache

PagedBlockManager::PrefixMatch PagedBlockManager::match_prefix(const std::vector<int32_t>& tokens,
                                                               uint64_t extra_key) const {
  PrefixMatch match{{}, kRootHash};
  if (!enable_prefix_caching_) return match;
  // Only full blocks within the first len-1 tokens: the last token is computed for its logits.
  const int64_t max_hits = (static_cast<int64_t>(tokens.size()) - 1) / block_size_;
  BlockRef parent{kNullBlock, 0};
  for (int64_t i = 0; i < max_hits; ++i) {
    const int32_t* block_tokens = tokens.data() + i * block_size_;
    const uint64_t hash = hash_fn_(match.last_hash, block_tokens, block_size_, extra_key);
    const auto it = cached_.find(hash);
    if (it == cached_.end() || !holds(it->second, block_tokens, extra_key, parent)) break;
    match.blocks.push_back(it->second);
    match.last_hash = hash;
    parent = ref(it->second);
  }
  return match;
}

// A hash match is a hit only if the content matches too, and the parent is the very block (same
// id, same allocation) that the previous position matched: a hash collision cannot serve wrong KV.
bool PagedBlockManager::holds(int32_t block_id, const int32_t* tokens, uint64_t extra_key,
                              BlockRef parent) const {
  const Block& block = blocks_[block_id];
  return block.extra_key == extra_key && block.parent == parent &&
         std::equal(block.tokens.begin(), block.tokens.end(), tokens);
}

// Whether `ref` can still be the parent of a hit: the root, or a block still cached since then.
bool PagedBlockManager::is_live(BlockRef ref) const {
  if (ref.id == kNullBlock) return true;
  if (ref.id == kBrokenChain) return false;
  const Block& block = blocks_[ref.id];
  return block.cached && block.generation == ref.generation;
}

void PagedBlockManager::cache_full_block(Sequence& seq, int64_t index) {
  if (!is_live(seq.chain_ref)) {  // a block before this one is not cached: nothing can reach it
    seq.chain_ref = {kBrokenChain, 0};
    return;
  }
  const int32_t* tokens = seq.tokens.data() + index * block_size_;
  const uint64_t hash = hash_fn_(seq.chain_hash, tokens, block_size_, seq.extra_key);
  const int32_t own = seq.block_table[index];
  seq.chain_hash = hash;
  const auto it = cached_.find(hash);
  if (it != cached_.end() && it->second != own) {
    const int32_t other = it->second;
    if (holds(other, tokens, seq.extra_key, seq.chain_ref)) {  // same content: keep one copy
      seq.chain_ref = ref(other);
      return;
    }
    if (is_live(blocks_[other].parent)) {  // a true collision: the first block keeps the hash
      seq.chain_ref = {kBrokenChain, 0};
      return;
    }
    uncache(other);  // its parent was evicted, so no prefix reaches it any more
  }
  if (!blocks_[own].cached) cache(own, hash, tokens, seq.extra_key, seq.chain_ref);
  seq.chain_ref = ref(own);
}

void PagedBlockManager::cache(int32_t block_id, uint64_t hash, const int32_t* tokens,
                              uint64_t extra_key, BlockRef parent) {
  Block& block = blocks_[block_id];
  block.cached = true;
  block.hash = hash;
  block.extra_key = extra_key;
  block.parent = parent;
  block.tokens.assign(tokens, tokens + block_size_);
  cached_.emplace(hash, block_id);
}

void PagedBlockManager::uncache(int32_t block_id) {
  Block& block = blocks_[block_id];
  cached_.erase(block.hash);
  block.cached = false;
  block.tokens.clear();
  if (free_queue_.contains(block_id)) {  // now worthless: reuse it before any cached block
    free_queue_.remove(block_id);
    free_queue_.push_front(block_id);
  }
}

void PagedBlockManager::reset_prefix_cache() {
  for (int32_t b : free_queue_.to_vector()) {
    if (blocks_[b].cached) uncache(b);
  }
}

// ---------------------------------------------------------------------------------------------
// Invariants

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
    if (seq.num_lookahead < 0 ||
        static_cast<int64_t>(seq.block_table.size()) != blocks_for(num_tokens + seq.num_lookahead)) {
      fail(name + " has " + std::to_string(seq.block_table.size()) + " blocks for " +
           std::to_string(num_tokens) + " tokens and " + std::to_string(seq.num_lookahead) +
           " lookahead slots");
    }
    // Blocks holding only lookahead slots are the sequence's own and never cached.
    for (size_t i = blocks_for(num_tokens); i < seq.block_table.size(); ++i) {
      const Block& block = blocks_[seq.block_table[i]];
      if (block.ref_count != 1 || block.cached) fail(name + " shares or caches a lookahead block");
    }
    if (seq.num_computed < 0 || seq.num_computed > num_tokens) fail(name + " computed count");
    const int64_t num_hashed = enable_prefix_caching_ ? seq.num_computed / block_size_ : 0;
    if (seq.num_hashed != num_hashed) fail(name + " hashed " + std::to_string(seq.num_hashed));
    for (int32_t b : seq.block_table) {
      if (b <= kNullBlock || b >= num_blocks()) fail(name + " holds block " + std::to_string(b));
      ++table_refs[b];
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
    const auto it = cached_.find(block.hash);
    if (it == cached_.end() || it->second != b) fail(name(b) + " is cached but not mapped");
    if (is_live(block.parent)) {
      const uint64_t parent_hash =
          block.parent.id == kNullBlock ? kRootHash : blocks_[block.parent.id].hash;
      if (hash_fn_(parent_hash, block.tokens.data(), block_size_, block.extra_key) != block.hash) {
        fail(name(b) + " is cached under a hash that its content does not give");
      }
    }
  }
  if (num_used + static_cast<int64_t>(queue.size()) != num_usable_blocks()) fail("block count");
  for (const auto& [hash, b] : cached_) {
    if (!blocks_[b].cached || blocks_[b].hash != hash) fail("stale hash map entry");
  }
}

}  // namespace kvserve
