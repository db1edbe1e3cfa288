#pragma once
// Which blocks of the paged KV cache each sequence owns: block ids, reference counts and
// prefix-cache hashes only (the tensors live in the KV cache; a slot is block_id * block_size +
// offset). Plain C++ without torch, so the scheduler's memory decisions are testable on their own.
// Modelled on vLLM v1's KVCacheManager and BlockPool.

#include <cstdint>
#include <functional>
#include <unordered_map>
#include <vector>

namespace kvserve {

/// Copy the whole of block `src` into block `dst` (every layer, key and value) before the step
/// writes into `dst`: copy-on-write of a shared, partially filled block.
struct BlockCopy {
  int32_t src;
  int32_t dst;
  bool operator==(const BlockCopy& other) const { return src == other.src && dst == other.dst; }
};

/// Hash of one full block from its parent's hash, its `num_tokens` token ids and the sequence's
/// extra key (LoRA id, cache salt). Must be deterministic.
using BlockHashFn = std::function<uint64_t(uint64_t parent_hash, const int32_t* tokens,
                                           int64_t num_tokens, uint64_t extra_key)>;

/// The pool of KV cache blocks, the block table of every sequence and the prefix cache.
///
/// Block 0 is the null block (padding rows of block tables): never handed out, so blocks
/// 1..num_blocks-1 are usable. A block is either free (in the free queue, reference count 0) or
/// referenced by the tables holding it. A full block whose KV is written (mark_computed) enters the
/// prefix cache under a hash chained over its prefix; it stays reusable after it is freed, until it
/// is evicted to serve an allocation (least recently used first).
///
/// Errors: unknown sequence ids throw std::out_of_range; invalid arguments std::invalid_argument;
/// running out of blocks std::runtime_error. A call that throws changes nothing.
class PagedBlockManager {
 public:
  /// num_blocks >= 2 (including the null block), block_size >= 1 tokens, watermark in [0, 1) as a
  /// fraction of the usable blocks that new prompts must leave free. hash_fn replaces the default
  /// block hash (tests use it to force collisions). Throws std::invalid_argument.
  explicit PagedBlockManager(int64_t num_blocks, int64_t block_size = 16,
                             bool enable_prefix_caching = true, double watermark = 0.01,
                             BlockHashFn hash_fn = nullptr);

  /// The default block hash: splitmix64 mixing, the same in every run.
  static uint64_t default_block_hash(uint64_t parent_hash, const int32_t* tokens,
                                     int64_t num_tokens, uint64_t extra_key);

  /// Whether a new sequence with this prompt fits while keeping the watermark free, counting the
  /// prefix-hit blocks that are now free as taken. Throws std::invalid_argument on a bad prompt.
  bool can_allocate(const std::vector<int32_t>& prompt_tokens, uint64_t extra_key = 0) const;

  /// Registers `seq_id` with blocks for its whole prompt, reusing the cached full blocks of its
  /// longest cached prefix; at least the last prompt token is left uncached. Returns how many
  /// prompt tokens have their KV cached (a multiple of block_size); they count as computed.
  /// Throws std::invalid_argument (id taken, empty prompt, negative token id) or
  /// std::runtime_error (not enough free blocks; the watermark is not applied here).
  int64_t allocate(int64_t seq_id, const std::vector<int32_t>& prompt_tokens,
                   uint64_t extra_key = 0);

  /// Whether appending `num_new_tokens` to `seq_id` with `num_lookahead` slots after them fits
  /// (copy-on-write block included).
  bool can_append_slots(int64_t seq_id, int64_t num_new_tokens, int64_t num_lookahead = 0) const;

  /// Appends tokens whose KV the next step writes, adding blocks as needed, and reserves
  /// `num_lookahead` slots after them: positions the step may write without tokens of the sequence
  /// yet (speculative draft tokens). The reservation is exactly tokens + num_lookahead: blocks a
  /// smaller lookahead no longer reaches go back to the pool (rejected drafts' slots are reused by
  /// the next tokens). If the last block is partially filled and shared, the sequence gets a
  /// fresh copy of it first; the returned copies must be applied to the KV tensors before the
  /// step. Throws std::runtime_error when out of blocks, std::invalid_argument on a negative
  /// token id or lookahead.
  std::vector<BlockCopy> append_slots(int64_t seq_id, const std::vector<int32_t>& new_tokens,
                                      int64_t num_lookahead = 0);

  /// Records that the first `num_computed_tokens` tokens of `seq_id` have their KV written; full
  /// blocks among them enter the prefix cache. Throws std::invalid_argument if the count goes
  /// backwards or past the sequence's tokens.
  void mark_computed(int64_t seq_id, int64_t num_computed_tokens);

  /// Registers `child_id` sharing all of `parent_id`'s blocks, tokens and computed count (not its
  /// lookahead slots). Fork before appending the child's own tokens. Throws std::invalid_argument if the child id exists.
  void fork(int64_t parent_id, int64_t child_id);

  /// Drops `seq_id`; blocks no longer referenced go back to the free queue (cached ones stay
  /// reusable by prefix hits until evicted).
  void free(int64_t seq_id);

  /// Forgets the hashes of all free cached blocks (blocks in use keep theirs).
  void reset_prefix_cache();

  /// Throws std::logic_error naming the first broken invariant of blocks, queue, tables and cache.
  void check_invariants() const;

  /// Blocks in the pool, the null block included.
  int64_t num_blocks() const { return static_cast<int64_t>(blocks_.size()); }
  /// Tokens per block.
  int64_t block_size() const { return block_size_; }
  /// Blocks that can be handed out: num_blocks - 1.
  int64_t num_usable_blocks() const { return num_blocks() - 1; }
  /// Blocks in the free queue, cached ones included.
  int64_t num_free_blocks() const { return free_queue_.size(); }
  /// Fraction of the usable blocks referenced by some sequence.
  double usage() const;
  /// Blocks in the prefix cache, free or in use.
  int64_t num_cached_blocks() const { return static_cast<int64_t>(cached_.size()); }
  /// Prompt tokens looked up in the prefix cache, and those found (vLLM's queries and hits).
  int64_t prefix_cache_queries() const { return prefix_cache_queries_; }
  int64_t prefix_cache_hits() const { return prefix_cache_hits_; }
  /// Cached blocks whose hash was dropped to reuse them for other content.
  int64_t num_evictions() const { return num_evictions_; }
  /// The free queue, next to be handed out first.
  std::vector<int32_t> free_block_ids() const;
  /// Throws std::out_of_range for an id outside [0, num_blocks).
  int32_t ref_count(int32_t block_id) const;

  /// Whether `seq_id` is allocated (and not freed).
  bool has_sequence(int64_t seq_id) const { return sequences_.count(seq_id) > 0; }
  /// Sequences allocated or forked and not freed.
  int64_t num_sequences() const { return static_cast<int64_t>(sequences_.size()); }
  /// Block ids of `seq_id` in token order: position p lives in block_table[p / block_size].
  const std::vector<int32_t>& block_table(int64_t seq_id) const {
    return sequence(seq_id).block_table;
  }
  /// Tokens of `seq_id`: prompt plus appended.
  int64_t num_tokens(int64_t seq_id) const;
  /// Slots reserved after the tokens of `seq_id` (see append_slots).
  int64_t num_lookahead(int64_t seq_id) const { return sequence(seq_id).num_lookahead; }
  /// Leading tokens of `seq_id` whose KV is written (prefix hits included).
  int64_t num_computed_tokens(int64_t seq_id) const { return sequence(seq_id).num_computed; }

 private:
  /// A block at one allocation: generations tell a live parent from a reused block id.
  struct BlockRef {
    int32_t id;
    uint64_t generation;
    bool operator==(const BlockRef& other) const {
      return id == other.id && generation == other.generation;
    }
  };

  struct Block {
    int32_t ref_count = 0;
    uint64_t generation = 0;  ///< bumped each time the block is handed out
    bool cached = false;      ///< in cached_ under `hash`
    // Valid while cached: what a prefix hit must match besides the hash.
    uint64_t hash = 0;
    uint64_t extra_key = 0;
    BlockRef parent{0, 0};
    std::vector<int32_t> tokens;
  };

  struct Sequence {
    std::vector<int32_t> tokens;
    std::vector<int32_t> block_table;  ///< covers tokens + num_lookahead slots
    int64_t num_lookahead = 0;
    int64_t num_computed = 0;
    uint64_t extra_key = 0;
    // Prefix-cache chain over the first num_hashed full computed blocks: the last block's hash and
    // the cached block holding its content (parent of the next one; id -1 once the chain broke).
    int64_t num_hashed = 0;
    uint64_t chain_hash = 0;
    BlockRef chain_ref{0, 0};
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

  /// Longest verified cached prefix of a prompt (full blocks within its first len-1 tokens).
  struct PrefixMatch {
    std::vector<int32_t> blocks;
    uint64_t last_hash;
  };

  const Sequence& sequence(int64_t seq_id) const;
  Sequence& sequence(int64_t seq_id);
  int64_t blocks_for(int64_t num_tokens) const {
    return (num_tokens + block_size_ - 1) / block_size_;
  }
  int64_t num_free_among(const std::vector<int32_t>& block_ids) const;
  bool needs_copy_on_write(const Sequence& seq) const;
  PrefixMatch match_prefix(const std::vector<int32_t>& tokens, uint64_t extra_key) const;
  bool holds(int32_t block_id, const int32_t* tokens, uint64_t extra_key, BlockRef parent) const;
  bool is_live(BlockRef ref) const;
  BlockRef ref(int32_t block_id) const { return {block_id, blocks_[block_id].generation}; }

  int32_t take_free_block();
  void acquire(int32_t block_id);
  void release(int32_t block_id);
  void cache_full_block(Sequence& seq, int64_t index);
  void cache(int32_t block_id, uint64_t hash, const int32_t* tokens, uint64_t extra_key,
             BlockRef parent);
  void uncache(int32_t block_id);
  void check_block_invariants(const std::vector<int64_t>& table_refs) const;

  int64_t block_size_;
  bool enable_prefix_caching_;
  int64_t watermark_blocks_;
  BlockHashFn hash_fn_;
  std::vector<Block> blocks_;
  FreeBlockQueue free_queue_;
  std::unordered_map<uint64_t, int32_t> cached_;  ///< block hash -> block id
  std::unordered_map<int64_t, Sequence> sequences_;
  int64_t prefix_cache_queries_ = 0;
  int64_t prefix_cache_hits_ = 0;
  int64_t num_evictions_ = 0;
};

}  // namespace kvserve
