#pragma once
// One sequence's tokens and progress, written once: the engine owns a SequenceTable; the
// Scheduler adds, forks, advances and drops its entries; the ModelRunner and the proposers read
// a sequence's history from it. (The block tables are the PagedBlockManager's; what a step feeds
// the model travels in the SchedulerOutput.) Plain C++ without torch.

#include <cstdint>
#include <limits>
#include <unordered_map>
#include <vector>

namespace kvserve {

/// A token that a launched step is still sampling (asynchronous scheduling): it stands at the end
/// of a sequence until the engine learns it (Scheduler::set_pending_token). The step after the
/// launched one feeds it on the device; it never enters a prefix-cache hash.
constexpr int32_t kPendingToken = -1;

struct SequenceState {
  int64_t seq_id = 0;
  std::vector<int32_t> token_ids;  ///< the prompt, then every token appended since
  int64_t num_prompt_tokens = 0;
  /// Leading tokens whose KV is in the cache (0 again after a preemption).
  int64_t num_computed_tokens = 0;
  /// Prompt tokens the prefix cache supplied when the sequence was (last) admitted.
  int64_t num_cached_tokens = 0;
  /// Tokens it may hold after its prompt (caps the draft tokens scheduled for it).
  int64_t max_new_tokens = std::numeric_limits<int64_t>::max();
  int64_t priority = 0;    ///< lower values are admitted first
  int32_t lora_slot = -1;  ///< the LoRA adapter slot its tokens run with (-1: none)
  uint64_t cache_key = 0;  ///< salts its prefix-cache hashes (0: none)
  /// Times it was given blocks (admitted, or readmitted after a preemption): KV that something
  /// else computed for it under an earlier count (a draft model's) is gone.
  int64_t num_admissions = 0;

  int64_t num_tokens() const { return static_cast<int64_t>(token_ids.size()); }
  int64_t num_output_tokens() const { return num_tokens() - num_prompt_tokens; }
};

/// The live sequences by id. References to entries stay valid until the entry is erased.
class SequenceTable {
 public:
  /// Throws std::invalid_argument if state.seq_id is taken.
  SequenceState& add(SequenceState state);
  /// A copy of `parent_id` under `child_id`. Throws std::out_of_range for an unknown parent and
  /// std::invalid_argument if the child id is taken.
  SequenceState& fork(int64_t parent_id, int64_t child_id);
  /// Throws std::out_of_range for an unknown id.
  void erase(int64_t seq_id);

  /// Throws std::out_of_range naming an unknown id.
  SequenceState& at(int64_t seq_id);
  const SequenceState& at(int64_t seq_id) const;
  bool contains(int64_t seq_id) const { return states_.count(seq_id) > 0; }
  int64_t size() const { return static_cast<int64_t>(states_.size()); }

 private:
  std::unordered_map<int64_t, SequenceState> states_;
};

}  // namespace kvserve
