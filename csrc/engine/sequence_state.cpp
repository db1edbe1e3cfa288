#include "kvserve/sequence_state.h"

#include <stdexcept>
#include <string>

namespace kvserve {

SequenceState& SequenceTable::add(SequenceState state) {
  const int64_t id = state.seq_id;
  auto [it, inserted] = states_.try_emplace(id, std::move(state));
  if (!inserted) {
    throw std::invalid_argument("sequence id " + std::to_string(id) + " already exists");
  }
  return it->second;
}

SequenceState& SequenceTable::fork(int64_t parent_id, int64_t child_id) {
  SequenceState child = at(parent_id);
  child.seq_id = child_id;
  return add(std::move(child));
}

void SequenceTable::erase(int64_t seq_id) {
  if (states_.erase(seq_id) == 0) {
    throw std::out_of_range("unknown sequence id " + std::to_string(seq_id));
  }
}

SequenceState& SequenceTable::at(int64_t seq_id) {
  auto it = states_.find(seq_id);
  if (it == states_.end()) {
    throw std::out_of_range("unknown sequence id " + std::to_string(seq_id));
  }
  return it->second;
}

const SequenceState& SequenceTable::at(int64_t seq_id) const {
  return const_cast<SequenceTable*>(this)->at(seq_id);
}

}  // namespace kvserve
