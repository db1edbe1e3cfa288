#pragma once
// The blocks of a paged KV cache as a pool: reference counts, the free queue in eviction order
// and the prefix-cache map from a block's key to the block holding that content. It knows
// nothing of sequences, tables or groups of layers: the PagedBlockManager builds those on it
// (as vLLM v1's KVCacheManager does on its BlockPool). Plain C++ without torch.

#include <cstdint>
#include <unordered_map>
#include <vector>

namespace kvserve {

/// A block at one allocation: generations tell a live parent from a reused block id.
struct BlockRef {
  int32_t id;
  uint64_t generation;
  bool operator==(const BlockRef& other) const {
    return id == other.id && generation == other.generation;
  }
};

/// What a cached block holds, besides its KV: what a prefix hit must match.
struct CachedBlock {
  uint64_t hash = 0;         ///< chained over the prefix's tokens
  uint64_t key = 0;          ///< its key in the pool's map (the hash salted by its user)
  int64_t group = 0;         ///< the group of layers whose table it serves
  uint64_t parent_hash = 0;  ///< the previous block's hash
  uint64_t extra_key = 0;    ///< the sequence's salt (LoRA adapter, cache key)
  BlockRef parent{0, 0};     ///< the previous block itself
  std::vector<int32_t> tokens;
};

/// Block 0 is the null block (padding of block tables): never handed out, so blocks
/// 1..num_blocks-1 are usable. A block is either free (in the free queue, reference count 0) or
/// referenced. A cached block stays in the map after it is freed, reusable by a prefix hit until
/// take() evicts it to hand it out. The free queue hands out uncached blocks first, then cached
/// ones least recently freed first.
class BlockPool {
 public:
  /// Throws std::invalid_argument unless 2 <= num_blocks < 2^31 - 1.
  explicit BlockPool(int64_t num_blocks);

  /// Hands out the head of the free queue with reference count 1 (evicting its cached content).
  /// The caller checks num_free_blocks() first; throws std::logic_error on an empty queue.
  int32_t take();
  /// One more reference to a block: a free one (a prefix hit) leaves the free queue.
  void acquire(int32_t block_id);
  /// One reference fewer; at zero the block goes to the free queue: an uncached one to its head
  /// (hand out first), a cached one to its tail (evict last).
  void release(int32_t block_id);

  /// The block mapped to `key`, or -1.
  int32_t find(uint64_t key) const;
  /// Maps content.key to `block_id` (the key must be unmapped, the block uncached).
  void cache(int32_t block_id, CachedBlock content);
  /// Forgets a block's content; a free one moves to the head of the free queue.
  void uncache(int32_t block_id);
  /// Forgets the content of every free cached block (blocks in use keep theirs).
  void reset_prefix_cache();

  /// Whether `ref` can still be the parent of a hit: the null block (the root), or a block cached
  /// since that allocation. Ids < 0 are never live.
  bool is_live(BlockRef ref) const;
  BlockRef ref(int32_t block_id) const { return {block_id, blocks_[block_id].generation}; }
  /// The content of a cached block (meaningless for others).
  const CachedBlock& content(int32_t block_id) const { return blocks_[block_id].content; }
  bool is_cached(int32_t block_id) const { return blocks_[block_id].cached; }
  /// Throws std::out_of_range for an id outside [0, num_blocks).
  int32_t ref_count(int32_t block_id) const;

  int64_t num_blocks() const { return static_cast<int64_t>(blocks_.size()); }
  int64_t num_usable_blocks() const { return num_blocks() - 1; }
  int64_t num_free_blocks() const { return free_queue_.size(); }
  int64_t num_cached_blocks() const { return static_cast<int64_t>(cached_.size()); }
  /// Cached blocks whose content was dropped to hand them out.
  int64_t num_evictions() const { return num_evictions_; }
  /// The free queue, next to be handed out first.
  std::vector<int32_t> free_block_ids() const { return free_queue_.to_vector(); }
  /// Fraction of the usable blocks referenced.
  double usage() const;

  /// Throws std::logic_error naming the first broken invariant: `table_refs[b]` is how many table
  /// entries hold block b, and must be its reference count.
  void check_invariants(const std::vector<int64_t>& table_refs) const;

 private:
  struct Block {
    int32_t ref_count = 0;
    uint64_t generation = 0;  ///< bumped each time the block is handed out
    bool cached = false;      ///< mapped under content.key
    CachedBlock content;      ///< valid while cached
  };

  /// Free blocks, head first: an intrusive doubly-linked list over block ids, so that a prefix hit
  /// takes a free cached block out of the middle in O(1).
  class FreeBlockQueue {
   public:
    explicit FreeBlockQueue(int32_t num_blocks);
    void push_front(int32_t block_id) { insert_before(next_[sentinel_], block_id); }
    void push_back(int32_t block_id) { insert_before(sentinel_, block_id); }
    int32_t pop_front();
    void remove(int32_t block_id);
    bool contains(int32_t block_id) const { return contains_[block_id]; }
    int64_t size() const { return size_; }
    /// Head to tail; throws std::logic_error if the links are corrupt.
    std::vector<int32_t> to_vector() const;

   private:
    void insert_before(int32_t position, int32_t block_id);
    int32_t sentinel_;  ///< == num_blocks: list head and tail
    std::vector<int32_t> prev_, next_;
    std::vector<bool> contains_;
    int64_t size_ = 0;
  };

  std::vector<Block> blocks_;
  FreeBlockQueue free_queue_;
  std::unordered_map<uint64_t, int32_t> cached_;  ///< content key -> block id
  int64_t num_evictions_ = 0;
};

}  // namespace kvserve
