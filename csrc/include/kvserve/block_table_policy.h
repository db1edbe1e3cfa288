#pragma once
// How one group of layers keeps a sequence's block table: what part of the sequence it covers,
// which blocks it may give back, and how its cached blocks are matched (vLLM v1 has one
// SingleTypeKVCacheManager per attention type for this). Full attention keeps a block for every
// position; a sliding window of W tokens only the blocks its next queries can see. Plain C++.

#include <algorithm>
#include <cstdint>

namespace kvserve {

class BlockTablePolicy {
 public:
  /// window: the group's sliding window in tokens (0: full attention).
  BlockTablePolicy(int64_t window, int64_t block_size) : window_(window), block_size_(block_size) {}

  int64_t window() const { return window_; }
  bool sliding() const { return window_ > 0; }

  /// Positions a table covers: full attention every token and lookahead slot (up to full_end); a
  /// sliding window what its prefill chunks reserved so far (up to sliding_end), since it reserves
  /// chunk by chunk instead of the whole prompt at admission.
  int64_t table_end(int64_t full_end, int64_t sliding_end) const {
    return sliding() ? sliding_end : full_end;
  }
  /// Blocks a table covering `end` positions holds, null entries included.
  int64_t table_size(int64_t full_end, int64_t sliding_end) const {
    return blocks_for(table_end(full_end, sliding_end));
  }

  /// The first block that queries from position `num_computed` on can see: 0 for full attention,
  /// the block of position num_computed - W + 1 for a window. Blocks before it may go back to
  /// the pool.
  int64_t first_visible_block(int64_t num_computed) const {
    return sliding() ? std::max<int64_t>(0, num_computed - window_ + 1) / block_size_ : 0;
  }

  /// The most blocks a table holds while a step computes [length - chunk, length) of a sequence
  /// of `length` positions: all of them for full attention; for a window, those from
  /// (length - chunk - W + 1) / block_size on, at most all.
  int64_t max_blocks_held(int64_t length, int64_t chunk) const {
    const int64_t all = blocks_for(length);
    return sliding() ? std::min(all, (window_ + chunk - 1) / block_size_ + 2) : all;
  }

  /// How a prefix hit is verified. Full attention: a chain of cached blocks, each the child of
  /// the very block (id and allocation) before it. A window: its early blocks may be gone, so the
  /// blocks it still sees are checked against their tokens and their parent's chained hash.
  bool chains_parents() const { return !sliding(); }

 private:
  int64_t blocks_for(int64_t positions) const {
    return (positions + block_size_ - 1) / block_size_;
  }

  int64_t window_;
  int64_t block_size_;
};

}  // namespace kvserve
