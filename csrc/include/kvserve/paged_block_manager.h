#pragma once
// Which blocks of the paged KV cache each sequence owns: block ids, reference counts and
// prefix-cache hashes only (the tensors live in the KV cache; a slot is block_id * block_size +
// offset). Plain C++ without torch, so the scheduler's memory decisions are testable on their own.
// Modelled on vLLM v1's KVCacheManager and BlockPool.

#include <cstdint>
#include <functional>
#include <optional>
#include <unordered_map>
#include <vector>

#include "kvserve/block_pool.h"
#include "kvserve/block_table_policy.h"
#include "kvserve/sequence_state.h"

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

/// The block tables of every sequence and the prefix cache's matching, over a BlockPool.
///
/// Layers are grouped by how they attend (vLLM's hybrid KV cache manager): every group has one
/// block table per sequence, and all groups take their blocks from the one pool. A full-attention
/// group (window 0) keeps a block for every position. A sliding-window group of W tokens keeps
/// only the blocks that the sequence's next queries can see: positions from num_computed - W + 1
/// on. The blocks before that go back to the pool (and to the prefix cache's LRU) when the next
/// step's slots are reserved, and their entries in the table become the null block; and during a
/// prefill, such a group reserves blocks chunk by chunk (reserve_prefill) instead of for the whole
/// prompt at admission. A local group's blocks thus stay bounded by its window, whatever the
/// sequence length. One group of full attention is the plain paged cache.
///
/// Block 0 is the null block (padding rows of block tables). A block's reference count is the
/// number of table entries holding it. A full block whose KV is written (mark_computed) enters the
/// prefix cache under a hash chained over its prefix; it stays reusable after it is freed, until it
/// is evicted to serve an allocation (least recently used first).
///
/// Errors: unknown sequence ids throw std::out_of_range; invalid arguments std::invalid_argument;
/// running out of blocks std::runtime_error. A call that throws changes nothing.
/// How a PagedBlockManager is made; name the fields: PagedBlockManager({.num_blocks = 64}).
struct BlockManagerOptions {
  int64_t num_blocks = 0;  ///< >= 2, the null block included
  int64_t block_size = 16;  ///< tokens per block, >= 1
  bool enable_prefix_caching = true;
  /// In [0, 1): the fraction of the usable blocks that new prompts must leave free.
  double watermark = 0.01;
  /// Replaces the default block hash (tests use it to force collisions).
  BlockHashFn hash_fn = nullptr;
  /// One entry per group of layers, its sliding window in tokens (0: full attention); the
  /// default is one full-attention group.
  std::vector<int64_t> group_windows = {0};
  /// State slots of a model with state-space layers (KVCacheLayout's state group), 0 for none:
  /// every sequence holds one from allocate (or fork) to free.
  int64_t num_state_slots = 0;
  /// With state slots, prefix caching needs states saved at block boundaries (snapshots; vLLM's
  /// "align" mode): this many more slots of the state pool (ids from num_state_slots on) hold
  /// the state of a cached block's prefix, and a prefix hit ends only at a block that has one.
  /// Prefix caching with state slots needs at least one, and a first group of full attention
  /// (whose blocks identify the prefix).
  int64_t num_state_snapshots = 0;
  /// With state slots, speculative decoding: one more slot per sequence slot (ids after the
  /// snapshots') keeps a sequence's state from before a step that verifies drafts, for when a
  /// draft is rejected (back_up_state, restore_state).
  bool state_backups = false;
};

/// Copy state slot `src` into `dst` (every state layer) before the step: a forked sequence
/// continues from its parent's state.
struct StateCopy {
  int32_t src;
  int32_t dst;
  bool operator==(const StateCopy& other) const { return src == other.src && dst == other.dst; }
};

class PagedBlockManager {
 public:
  /// Throws std::invalid_argument naming a bad option.
  explicit PagedBlockManager(BlockManagerOptions options);

  /// The default block hash: splitmix64 mixing, the same in every run.
  static uint64_t default_block_hash(uint64_t parent_hash, const int32_t* tokens,
                                     int64_t num_tokens, uint64_t extra_key);

  /// Whether a new sequence with this prompt fits while keeping the watermark free, counting the
  /// prefix-hit blocks that are now free as taken. num_scheduled and num_states as for
  /// allocate. Throws std::invalid_argument on a bad prompt.
  bool can_allocate(const std::vector<int32_t>& prompt_tokens, uint64_t extra_key = 0,
                    int64_t num_scheduled = -1, int64_t num_states = 1) const;

  /// Registers `seq_id` with blocks for its prompt, reusing the cached blocks of its longest
  /// cached prefix; at least the last prompt token is left uncached. Full-attention groups get
  /// blocks for the whole prompt; sliding-window groups for the cached window and the first
  /// num_scheduled tokens after the hit (-1: the rest of the prompt; reserve_prefill adds the
  /// later chunks). Returns how many prompt tokens have their KV cached (a multiple of
  /// block_size); they count as computed. With a state pool, the sequence also takes
  /// num_states (>= 1) state slots: its own (state_slot) and num_states - 1 kept for the
  /// sequences forked from it (its other samples), so that forking never runs out. Throws
  /// std::invalid_argument (id taken, empty prompt, negative token id, num_states < 1) or
  /// std::runtime_error (not enough free blocks or state slots; the watermark is not applied
  /// here).
  int64_t allocate(int64_t seq_id, const std::vector<int32_t>& prompt_tokens,
                   uint64_t extra_key = 0, int64_t num_scheduled = -1, int64_t num_states = 1);

  /// Whether reserve_prefill(seq_id, end) fits.
  bool can_reserve_prefill(int64_t seq_id, int64_t end) const;

  /// The next step computes the tokens of `seq_id` up to position `end` (exclusive, at most its
  /// token count): sliding-window groups give back the blocks before their window and get blocks
  /// up to `end` (full-attention groups hold every token's block already). Throws
  /// std::invalid_argument for an end beyond the tokens, std::runtime_error when out of blocks.
  void reserve_prefill(int64_t seq_id, int64_t end);

  /// Whether appending `num_new_tokens` to `seq_id` with `num_lookahead` slots after them fits
  /// (copy-on-write block included).
  bool can_append_slots(int64_t seq_id, int64_t num_new_tokens, int64_t num_lookahead = 0) const;

  /// Appends tokens whose KV the next step writes, adding blocks as needed (and giving back what
  /// fell out of the sliding windows), and reserves
  /// `num_lookahead` slots after them: positions the step may write without tokens of the sequence
  /// yet (speculative draft tokens). The reservation is exactly tokens + num_lookahead: blocks a
  /// smaller lookahead no longer reaches go back to the pool (rejected drafts' slots are reused by
  /// the next tokens). If the last block is partially filled and shared, the sequence gets a
  /// fresh copy of it first; the returned copies must be applied to the KV tensors before the
  /// step. Throws std::runtime_error when out of blocks, std::invalid_argument on a negative
  /// token id (but a last kPendingToken) or lookahead.
  std::vector<BlockCopy> append_slots(int64_t seq_id, const std::vector<int32_t>& new_tokens,
                                      int64_t num_lookahead = 0);

  /// The sampled value of the kPendingToken that ends `seq_id`'s tokens. Throws
  /// std::invalid_argument when its last token is not pending or `token` is negative.
  void set_pending_token(int64_t seq_id, int32_t token);

  /// Records that the first `num_computed_tokens` tokens of `seq_id` have their KV written; full
  /// blocks among them enter the prefix cache. Throws std::invalid_argument if the count goes
  /// backwards or past the sequence's tokens, std::logic_error if such a block holds a
  /// kPendingToken.
  void mark_computed(int64_t seq_id, int64_t num_computed_tokens);

  /// Registers `child_id` sharing all of `parent_id`'s blocks, tokens and computed count (not its
  /// lookahead slots). Fork before appending the child's own tokens. With a state pool the child
  /// takes a state slot (one the parent kept for it, else a free one) and a StateCopy from the
  /// parent's is queued (take_state_copies). Throws std::invalid_argument if the child id
  /// exists, std::runtime_error when no state slot is left.
  void fork(int64_t parent_id, int64_t child_id);

  /// The state slot of `seq_id` (-1 without a state pool).
  int32_t state_slot(int64_t seq_id) const { return sequence(seq_id).state_slot; }
  /// The state copies queued by fork and by prefix hits (a snapshot into the new sequence's
  /// slot) since the last call, to apply before the next step.
  std::vector<StateCopy> take_state_copies();
  /// Drops the queued state copies into `slot` (a sequence whose state another engine sends).
  void discard_state_copies_to(int32_t slot);
  /// State slots in the pool for sequences (0: none), and those no sequence holds or keeps.
  int64_t num_state_slots() const { return num_state_slots_; }
  int64_t num_free_state_slots() const { return static_cast<int64_t>(free_states_.size()); }

  /// State snapshots (BlockManagerOptions::num_state_snapshots). The next step computes the
  /// tokens of `seq_id` up to position `end`: where `end` is a block boundary, takes a snapshot
  /// slot (a free one, one whose block left the prefix cache, else the least recently used) and
  /// returns the copy of the sequence's state into it, to apply after the step's forward; the
  /// snapshot serves prefix hits once the step is committed (commit_state_snapshots). Returns
  /// nothing otherwise (no snapshots, not a boundary, the boundary block not cacheable).
  std::optional<StateCopy> snapshot_state(int64_t seq_id, int64_t end);
  /// After a step ran and its sequences were marked computed: its snapshots whose blocks entered
  /// the prefix cache become hits; the others' slots are free again.
  void commit_state_snapshots();
  /// Gives back the slots of snapshots planned and not committed (a step that did not run).
  void discard_state_snapshots();
  /// Where the next prefill chunk of `seq_id` should end so that its state there is saved: the
  /// end of the blocks its prompt shares with the prefix cache past its hit (another request
  /// computed them without a snapshot where this one's prompt parts from it), or 0. The next
  /// request sharing that prefix then resumes from there.
  int64_t snapshot_boundary(int64_t seq_id) const;
  /// Snapshot slots in the pool, and those holding a committed snapshot.
  int64_t num_state_snapshots() const { return num_state_snapshots_; }
  int64_t num_cached_states() const { return static_cast<int64_t>(snapshots_.size()); }
  /// Slots of the state pool: sequences', snapshots' and backups'.
  int64_t num_state_pool_slots() const {
    return num_state_slots_ + num_state_snapshots_ + (state_backups_ ? num_state_slots_ : 0);
  }

  /// Speculative decoding over state-space layers (BlockManagerOptions::state_backups): a step
  /// that verifies drafts runs them through the sequence's state, which keeps them even when
  /// they are rejected. back_up_state returns the copy of the sequence's state into its backup
  /// slot, to apply before that step's forward; restore_state queues the copy back
  /// (take_state_copies) and sets the sequence's computed tokens back to
  /// `num_computed_tokens`, where the backup was taken (its blocks keep the K/V written since,
  /// which the tokens' recomputation writes again). Throws std::logic_error without backups.
  StateCopy back_up_state(int64_t seq_id) const;
  bool keeps_state_backups() const { return state_backups_; }
  void restore_state(int64_t seq_id, int64_t num_computed_tokens);

  /// Drops `seq_id`; blocks no longer referenced go back to the free queue (cached ones stay
  /// reusable by prefix hits until evicted).
  void free(int64_t seq_id);

  /// Forgets the hashes of all free cached blocks (blocks in use keep theirs).
  void reset_prefix_cache();

  /// Throws std::logic_error naming the first broken invariant of blocks, queue, tables and cache.
  void check_invariants() const;

  /// Blocks in the pool, the null block included.
  int64_t num_blocks() const { return pool_.num_blocks(); }
  /// Tokens per block.
  int64_t block_size() const { return block_size_; }
  /// Blocks that can be handed out: num_blocks - 1.
  int64_t num_usable_blocks() const { return num_blocks() - 1; }
  /// Blocks in the free queue, cached ones included.
  int64_t num_free_blocks() const { return pool_.num_free_blocks(); }
  /// Fraction of the usable blocks referenced by some sequence.
  double usage() const { return pool_.usage(); }
  /// Blocks in the prefix cache, free or in use.
  int64_t num_cached_blocks() const { return pool_.num_cached_blocks(); }
  /// Prompt tokens looked up in the prefix cache, and those found (vLLM's queries and hits).
  int64_t prefix_cache_queries() const { return prefix_cache_queries_; }
  int64_t prefix_cache_hits() const { return prefix_cache_hits_; }
  /// Cached blocks whose hash was dropped to reuse them for other content.
  int64_t num_evictions() const { return pool_.num_evictions(); }
  /// The free queue, next to be handed out first.
  std::vector<int32_t> free_block_ids() const { return pool_.free_block_ids(); }
  /// Throws std::out_of_range for an id outside [0, num_blocks).
  int32_t ref_count(int32_t block_id) const { return pool_.ref_count(block_id); }
  /// The blocks themselves: reference counts, free queue, prefix-cache map.
  const BlockPool& pool() const { return pool_; }

  /// Whether `seq_id` is allocated (and not freed).
  bool has_sequence(int64_t seq_id) const { return sequences_.count(seq_id) > 0; }
  /// Sequences allocated or forked and not freed.
  int64_t num_sequences() const { return static_cast<int64_t>(sequences_.size()); }
  /// Block ids of `seq_id` in `group`, in token order: position p lives in
  /// block_table[p / block_size]. A sliding-window group's table covers the positions reserved
  /// for it, with the null block (0) before its window.
  const std::vector<int32_t>& block_table(int64_t seq_id, int64_t group = 0) const {
    return sequence(seq_id).tables.at(group);
  }
  /// The most blocks one sequence holds at once over all groups when its prompt of num_prompt
  /// tokens is computed in chunks of at most max_chunk tokens and it then decodes up to
  /// num_tokens: a block per block_size tokens in a full-attention group, its window and the
  /// step's tokens in a sliding one (at the end of the prefill, or at the end of the decode).
  int64_t max_blocks_held(int64_t num_prompt, int64_t num_tokens, int64_t max_chunk) const;
  /// The same bound for a manager of these groups and block size, before there is one (the
  /// engine sizes its pool with it).
  static int64_t max_blocks_held(const std::vector<int64_t>& group_windows, int64_t block_size,
                                 int64_t num_prompt, int64_t num_tokens, int64_t max_chunk);
  /// Blocks of `seq_id` in `group` other than the null block.
  int64_t num_live_blocks(int64_t seq_id, int64_t group) const;
  /// Groups of layers, each with its own block tables.
  int64_t num_groups() const { return static_cast<int64_t>(groups_.size()); }
  /// The sliding window of `group` in tokens; 0 for full attention.
  int64_t group_window(int64_t group) const { return groups_.at(group).window(); }
  /// Every group's sliding window, in group order.
  std::vector<int64_t> group_windows() const;
  /// Tokens of `seq_id`: prompt plus appended.
  int64_t num_tokens(int64_t seq_id) const;
  /// Slots reserved after the tokens of `seq_id` (see append_slots).
  int64_t num_lookahead(int64_t seq_id) const { return sequence(seq_id).num_lookahead; }
  /// Leading tokens of `seq_id` whose KV is written (prefix hits included).
  int64_t num_computed_tokens(int64_t seq_id) const { return sequence(seq_id).num_computed; }

 private:
  struct Sequence {
    std::vector<int32_t> tokens;
    /// Per group. Full attention: covers tokens + num_lookahead slots. Sliding window: covers
    /// positions < sliding_end, the entries before live_from[group] being the null block.
    std::vector<std::vector<int32_t>> tables;
    std::vector<int64_t> live_from;
    int64_t sliding_end = 0;
    int64_t num_lookahead = 0;
    int64_t num_computed = 0;
    uint64_t extra_key = 0;
    int32_t state_slot = -1;                 // -1: no state pool
    int64_t snapshot_end = 0;                // see snapshot_boundary
    std::vector<int32_t> reserved_states;    // kept for the sequences forked from this one
    // Prefix-cache chain over the first num_hashed full computed blocks: the last block's hash,
    // and per full-attention group the cached block holding its content (parent of the next
    // one; id -1 once the chain broke).
    int64_t num_hashed = 0;
    uint64_t chain_hash = 0;
    std::vector<BlockRef> chain_refs;
  };

  /// Longest verified cached prefix of a prompt (full blocks within its first len-1 tokens):
  /// num_blocks blocks; per group the hit blocks (a sliding-window group's: those of its window
  /// before the hit, from index first[group] on). With a state pool, one whose last block has a
  /// snapshot of the state there (state_source, its slot).
  struct PrefixMatch {
    int64_t num_blocks = 0;
    std::vector<std::vector<int32_t>> blocks;
    std::vector<int64_t> first;
    uint64_t last_hash = 0;
    int32_t state_source = -1;
    int64_t num_shared_blocks = 0;  // the full groups' verified blocks, before the state's cut
  };

  /// A state saved at a cached block's end: its slot, the block (first group) whose prefix it
  /// is the state of (a hit must match that very block), when it last served a hit.
  struct StateSnapshot {
    int32_t slot;
    BlockRef block;
    uint64_t last_used;
  };
  /// A snapshot planned for a step: the sequence, the boundary; its hash and block once that
  /// block is cached (ready).
  struct PlannedSnapshot {
    int64_t seq_id;
    int64_t end;
    int32_t slot;
    bool ready = false;
    uint64_t hash = 0;
    BlockRef block{0, 0};
  };

  const Sequence& sequence(int64_t seq_id) const;
  Sequence& sequence(int64_t seq_id);
  /// Pops the next free state slot (the caller checked there is one).
  int32_t take_free_state();
  int64_t blocks_for(int64_t num_tokens) const {
    return (num_tokens + block_size_ - 1) / block_size_;
  }
  uint64_t group_key(uint64_t hash, int64_t group) const;
  int64_t num_free_among(const std::vector<int32_t>& block_ids) const;
  bool needs_copy_on_write(const Sequence& seq, int64_t group) const;
  /// Blocks a reservation of full groups to full_end and sliding groups to sliding_end takes
  /// from the free queue, less those its window moves give back.
  int64_t num_blocks_to_take(const Sequence& seq, int64_t full_end, int64_t sliding_end) const;
  /// Gives back sliding groups' blocks before the window of seq.num_computed.
  void drop_out_of_window(Sequence& seq);
  /// Grows (taking free blocks) or shrinks (releasing) a group's table to `size` entries.
  void resize_table(std::vector<int32_t>& table, int64_t size);
  PrefixMatch match_prefix(const std::vector<int32_t>& tokens, uint64_t extra_key) const;
  int64_t num_blocks_to_admit(const PrefixMatch& match, int64_t num_prompt,
                              int64_t sliding_end) const;
  /// Extends hashes (the chained hash of each full block of tokens) to `count` blocks.
  void extend_hashes(const std::vector<int32_t>& tokens, uint64_t extra_key,
                     std::vector<uint64_t>& hashes, int64_t count) const;
  /// A full-attention group's cached chain of at most `limit` blocks of tokens, into hits.
  void match_full_group(const std::vector<int32_t>& tokens, uint64_t extra_key, int64_t group,
                        int64_t limit, std::vector<uint64_t>& hashes,
                        std::vector<int32_t>& hits) const;
  /// Whether a sliding-window group holds the blocks of its window before block num_blocks;
  /// they go into hits.
  bool match_window(const std::vector<int32_t>& tokens, uint64_t extra_key, int64_t group,
                    int64_t num_blocks, std::vector<uint64_t>& hashes,
                    std::vector<int32_t>& hits) const;
  bool holds(int32_t block_id, const int32_t* tokens, uint64_t extra_key, BlockRef parent) const;

  void cache_full_block(Sequence& seq, int64_t group, int64_t index, uint64_t hash);
  void cache_window_block(Sequence& seq, int64_t group, int64_t index, uint64_t hash);
  void cache(int32_t block_id, int64_t group, uint64_t hash, const int32_t* tokens,
             uint64_t extra_key, BlockRef parent, uint64_t parent_hash);

  int64_t block_size_;
  std::vector<BlockTablePolicy> groups_;  ///< per group of layers
  bool enable_prefix_caching_;
  int64_t watermark_blocks_;
  BlockHashFn hash_fn_;
  BlockPool pool_;  ///< its map keys blocks by hash salted with the group (group_key)
  std::unordered_map<int64_t, Sequence> sequences_;
  int64_t num_state_slots_ = 0;
  bool state_backups_ = false;
  std::vector<int32_t> free_states_;  // the last is handed out next
  std::vector<StateCopy> state_copies_;
  int64_t num_state_snapshots_ = 0;
  std::unordered_map<uint64_t, StateSnapshot> snapshots_;  // by the block's chained hash
  std::vector<int32_t> free_snapshots_;
  std::vector<PlannedSnapshot> planned_snapshots_;
  uint64_t snapshot_clock_ = 0;
  /// The snapshot of the prefix ending with block `index` (hash `hash`, matched as block
  /// `block_id` in the first group), or nullptr.
  const StateSnapshot* snapshot_at(uint64_t hash, int32_t block_id) const;
  /// A snapshot slot for a new snapshot, or -1 (every one planned this step).
  int32_t take_snapshot_slot();
  /// Marks `seq`'s planned snapshot at its last hashed block ready (mark_computed).
  void ready_state_snapshot(int64_t seq_id, const Sequence& seq);
  int64_t prefix_cache_queries_ = 0;
  int64_t prefix_cache_hits_ = 0;
};

}  // namespace kvserve
