#pragma once
// Iteration-level scheduling: which sequences advance by how many tokens in the next engine step,
// under a token budget, with chunked prefill, prefix caching and preemption by recomputation.
// Plain C++ without torch: it moves sequence ids between queues, advances their SequenceState and
// asks the PagedBlockManager for blocks; the engine runs the model over what it schedules.

#include <cstdint>
#include <limits>
#include <list>
#include <set>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "kvserve/paged_block_manager.h"
#include "kvserve/sequence_state.h"

namespace kvserve {

struct SchedulerConfig {
  int64_t max_num_seqs = 256;             ///< running sequences at most
  int64_t max_num_batched_tokens = 2048;  ///< tokens per step (decodes + prefill chunks)
  int64_t max_model_len = 2048;           ///< tokens a sequence may hold (prompt + output)

  /// Throws std::invalid_argument naming the first bad field.
  void validate() const;
};

/// One sequence's share of a step: tokens [num_computed, num_computed + num_new_tokens) of it are
/// fed to the model; `samples` when they reach its last token, so its logits give the next one.
/// A decoding sequence may also get `num_speculative_tokens` slots after its tokens, reserved and
/// counted in the budget, for draft tokens that the step verifies (speculative decoding).
/// The entry carries everything the model's forward needs of the sequence, so that whoever runs
/// the step needs nothing else: the tokens it feeds, its block tables and its LoRA slot.
struct ScheduledSequence {
  int64_t seq_id;
  int64_t num_computed;
  int64_t num_new_tokens;
  bool samples;
  int64_t num_speculative_tokens = 0;
  /// Tokens [num_computed, num_computed + num_new_tokens) of the sequence.
  std::vector<int32_t> token_ids;
  /// Per group of layers, the block table the step reads and writes (its draft slots included).
  std::vector<std::vector<int32_t>> block_tables;
  int32_t lora_slot = -1;
  /// Its slot in the state pool of a model with state-space layers (-1: none). Its state holds
  /// the first num_computed tokens (none when num_computed is 0: the slot's content is stale).
  int32_t state_slot = -1;
  /// With draft slots and a pool that keeps backups: where the state is to be copied before the
  /// forward if drafts are proposed (PagedBlockManager::back_up_state; -1: nowhere).
  int32_t state_backup_slot = -1;
};

/// What one step runs. Decodes come first, then prefill chunks (running, then newly admitted).
struct SchedulerOutput {
  std::vector<ScheduledSequence> scheduled;
  std::vector<BlockCopy> block_copies;  ///< copy-on-write copies to do before the forward
  std::vector<StateCopy> state_copies;  ///< forked sequences' and prefix hits' states, also before
                                        ///< the forward
  /// States saved at block boundaries (PagedBlockManager::snapshot_state), after the forward.
  std::vector<StateCopy> state_snapshots;
  std::vector<int64_t> preempted;       ///< sent back to the waiting queue this step
  /// Sequences admitted this step whose prompt KV is loaded from elsewhere (add's load_prompt):
  /// their blocks are allocated; the step computes nothing for them.
  std::vector<int64_t> loads;
  int64_t num_batched_tokens = 0;

  bool empty() const { return scheduled.empty(); }
};

class Scheduler {
 public:
  /// The scheduler allocates from `blocks` and keeps its sequences in `sequences` (it adds, forks
  /// and erases their entries); both must outlive it.
  Scheduler(SchedulerConfig config, PagedBlockManager& blocks, SequenceTable& sequences);

  /// Queues a new sequence. Waiting sequences are admitted by (priority, arrival): a lower
  /// priority value first, first come first served among equals. Throws std::invalid_argument
  /// when the id exists, the prompt is empty or longer than max_model_len, or the prompt alone
  /// could never fit in the block pool. The sequence will hold at most max_new_tokens tokens
  /// after its prompt (it caps the draft tokens scheduled for it). lora_slot: the LoRA adapter
  /// slot its tokens run with (-1: none; kLoraPending: not admitted until set_lora gives it
  /// one, while the sequences behind it are); cache_key: what its prefix-cache hashes are salted
  /// with (0: none), so that sequences share cached blocks only under one key (one adapter).
  /// load_prompt: the prompt's KV comes from elsewhere (a KV transfer from a prefill engine):
  /// when admitted, the sequence gets blocks for its whole prompt (its prefix-cache hit
  /// included, those blocks are not loaded), is listed in SchedulerOutput::loads, and waits,
  /// holding its blocks and never preempted, until end_load. num_samples: how many sequences
  /// will fork from it (its n); with a state pool it is admitted only when it can hold that many
  /// state slots, and throws std::invalid_argument when the pool has fewer.
  void add(int64_t seq_id, std::vector<int32_t> prompt_token_ids, int64_t priority = 0,
           int64_t max_new_tokens = std::numeric_limits<int64_t>::max(), int32_t lora_slot = -1,
           uint64_t cache_key = 0, bool load_prompt = false, int64_t num_samples = 1);

  /// A waiting sequence's adapter slot and prefix-cache key (its adapter was loaded after it
  /// was added with kLoraPending). Throws std::out_of_range for an unknown sequence and
  /// std::logic_error for one that holds blocks.
  void set_lora(int64_t seq_id, int32_t lora_slot, uint64_t cache_key);

  /// add's lora_slot of a sequence whose adapter waits for a free slot.
  static constexpr int32_t kLoraPending = -2;

  /// A loading sequence's load ended. ok: its prompt's KV is written; the prompt counts as
  /// computed (its full blocks enter the prefix cache) and the sequence runs (append its first
  /// token next). Otherwise, or when the sequence was finished while loading, its blocks are
  /// freed. Returns whether it runs. Throws std::out_of_range for a sequence that is not loading.
  bool end_load(int64_t seq_id, bool ok);

  /// A finished sequence whose KV another engine will read: it leaves the queues and the
  /// sequence table but keeps its blocks (reference counts and all) until release(). Throws
  /// std::out_of_range for a sequence that is not running.
  void hold(int64_t seq_id);
  /// Frees a held sequence's blocks. Throws std::out_of_range for one that is not held.
  void release(int64_t seq_id);

  /// Picks the next step's work and reserves its KV slots. When blocks run out, preempts the
  /// most recently admitted running sequence: its blocks are freed and it goes back to the front
  /// of the waiting queue, to be recomputed (prompt + output so far) when it is readmitted.
  /// A newly admitted sequence's scheduled chunk counts as computed at once, so the sequences
  /// admitted after it in the same step can hit its prefix blocks (the forward writes all K/V
  /// before attention reads); the caller must run the step or abort these sequences.
  /// With num_speculative_tokens = k > 0, each decoding sequence that has output tokens also
  /// gets up to k draft slots (fewer near its max_new_tokens or max_model_len, or when the budget
  /// or the pool is short: speculation never preempts anything).
  SchedulerOutput schedule(int64_t num_speculative_tokens = 0);

  /// The step ran: advances what it scheduled and lets the block manager cache full blocks.
  void update_computed(const SchedulerOutput& output);

  /// Appends a sampled token to a sequence (its KV slot is reserved at the next schedule()) and
  /// releases its draft slots. With kv_written, the token is an accepted draft token whose KV the
  /// step already wrote in the next draft slot: it counts as computed at once.
  void append_token(int64_t seq_id, int32_t token, bool kv_written = false);

  /// With a state pool that keeps backups (speculative decoding over state-space layers): the
  /// step that verified `seq_id`'s drafts ran them all through its state. When some were
  /// rejected (`all_accepted` false), the state from before the step comes back and the
  /// sequence's tokens from the step's first on count as not computed, so that the next step
  /// recomputes them (the accepted drafts, then the new token) through the state. A no-op for a
  /// sequence that verified nothing or has no state.
  void settle_speculative_state(int64_t seq_id, bool all_accepted);

  /// Asynchronous scheduling: append_token(seq_id, kPendingToken) stands for a token that a
  /// launched step is still sampling, so that the next schedule() gives the sequence its slot;
  /// this sets its value once known. A running sequence whose every token is computed is
  /// skipped by schedule() (its step's sample ends it or appends). Throws std::invalid_argument
  /// when the sequence's last token is not pending or `token` is negative.
  void set_pending_token(int64_t seq_id, int32_t token);

  /// A new running sequence `child` sharing all of `parent`'s tokens and blocks (for n > 1
  /// samples of one prompt): call after the parent's prefill, before either appends a token.
  void fork(int64_t parent_id, int64_t child_id);

  /// Drops a sequence (finished or aborted) from whichever queue holds it, freeing its blocks;
  /// a loading sequence's blocks stay until end_load (the transfer may still write them).
  void finish(int64_t seq_id);

  bool has_pending_work() const {
    return !running_.empty() || !waiting_.empty() || !loading_.empty();
  }
  // Every operation above costs O(log waiting) at most in queue bookkeeping; schedule() walks
  // the running sequences once, and the waiting queue only as far as it admits.
  int64_t num_running() const { return static_cast<int64_t>(running_.size()); }
  int64_t num_waiting() const { return static_cast<int64_t>(waiting_.size()); }
  int64_t num_preemptions() const { return num_preemptions_; }
  /// Sequences whose prompt KV is being loaded (finished ones included until end_load).
  int64_t num_loading() const { return static_cast<int64_t>(loading_.size()); }
  /// Finished sequences holding their blocks for another engine (hold).
  int64_t num_held() const { return static_cast<int64_t>(held_.size()); }
  bool has_sequence(int64_t seq_id) const { return entries_.count(seq_id) > 0; }
  /// A queued or running sequence's state. Throws std::out_of_range for an unknown id.
  const SequenceState& sequence(int64_t seq_id) const { return *entry(seq_id).state; }
  /// Running sequences in admission order (the last one is preempted first).
  const std::list<int64_t>& running() const { return running_; }
  /// Waiting sequences in admission order (O(waiting): for tests and introspection).
  std::vector<int64_t> waiting() const;
  const SchedulerConfig& config() const { return config_; }
  const PagedBlockManager& block_manager() const { return blocks_; }

  /// Throws std::logic_error if the queues and the block manager disagree (tests).
  void check_invariants() const;

 private:
  /// Order of the waiting queue: preempted sequences first (the latest preempted first), then
  /// by (priority, arrival).
  using WaitKey = std::tuple<int, int64_t, int64_t, int64_t>;  // class, priority, order, seq id
  /// Where a sequence is queued (its state is the SequenceTable's).
  struct Entry {
    SequenceState* state;
    int64_t arrival = 0;
    bool allocated = false;  ///< holds blocks (running or loading)
    bool load_prompt = false;
    int64_t num_states = 1;  ///< state slots it takes when admitted (its samples, before forking)
    /// While a step verifies its drafts through a backed-up state: its computed tokens then.
    int64_t state_backed_up_at = -1;
    WaitKey wait_key;                          ///< while waiting
    std::list<int64_t>::iterator running_pos;  ///< while running
  };

  Entry& entry(int64_t seq_id);
  const Entry& entry(int64_t seq_id) const;
  void enqueue_waiting(int64_t seq_id, bool preempted);
  void start_running(int64_t seq_id);
  /// Reserves slots for seq's unallocated tokens, preempting from the back of running_ while
  /// they do not fit. False when seq itself had to be preempted.
  bool reserve_slots(int64_t seq_id, SchedulerOutput& out);
  /// The blocks a prefill chunk up to position `end` needs in sliding-window groups, preempting
  /// from the back of running_ while they do not fit. False when seq itself had to be preempted.
  bool reserve_prefill(int64_t seq_id, int64_t end, SchedulerOutput& out);
  /// Draft slots for a decoding sequence: up to `wanted`, within its limits and the budget, if
  /// the pool has them without preempting. Reserves them with its new token; 0 if none.
  int64_t reserve_draft_slots(int64_t seq_id, int64_t wanted, int64_t budget, SchedulerOutput& out);
  /// A prefill chunk of `chunk` tokens of `seq_id` after `num_computed`, where states are saved
  /// at boundaries (PagedBlockManager::snapshot_state): ended at the end of the prefix it shares
  /// with the cache past its hit (PagedBlockManager::snapshot_boundary) if the chunk crosses it,
  /// else at the last block boundary it crosses, so that the state there can be saved; the rest
  /// follows in the next step.
  int64_t aligned_chunk(int64_t seq_id, int64_t num_computed, int64_t chunk) const;
  void preempt_last(SchedulerOutput& out);
  void schedule_running(bool decodes, int64_t& budget, SchedulerOutput& out,
                        int64_t num_speculative_tokens);
  void admit_waiting(int64_t& budget, SchedulerOutput& out);
  /// Admits the first waiting sequence, a load_prompt one, to loading_; false when its blocks
  /// do not fit now.
  bool admit_load(int64_t seq_id);
  /// Fills each scheduled entry's tokens, block tables and LoRA slot.
  void describe(SchedulerOutput& out) const;

  SchedulerConfig config_;
  PagedBlockManager& blocks_;
  SequenceTable& sequences_;
  std::unordered_map<int64_t, Entry> entries_;
  std::list<int64_t> running_;  ///< in admission order; the back is preempted first
  std::set<WaitKey> waiting_;
  /// Loading sequences (allocated, neither running nor waiting); true once finished meanwhile.
  std::unordered_map<int64_t, bool> loading_;
  std::set<int64_t> held_;  ///< held sequences: in the block manager only
  int64_t next_arrival_ = 0;
  int64_t next_preemption_order_ = 0;
  int64_t num_preemptions_ = 0;
};

}  // namespace kvserve
