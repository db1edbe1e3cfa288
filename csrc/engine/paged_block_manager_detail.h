#pragma once
// Constants and hashing shared by the PagedBlockManager's source files.

#include <cstdint>

namespace kvserve::block_manager_detail {

constexpr int32_t kNullBlock = 0;
constexpr int32_t kBrokenChain = -1;  // BlockRef id of a chain whose next blocks are not cached
constexpr uint64_t kRootHash = 0x6b76736572766531ULL;  // parent hash of every first block

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Order-sensitive: the running hash is re-mixed after each value.
inline uint64_t combine(uint64_t hash, uint64_t value) {
  return splitmix64(hash ^ splitmix64(value));
}

}  // namespace kvserve::block_manager_detail
