#pragma once
// Where oneDNN's packed linear weight keeps each element, so that kvserve's GEMV can read the
// same copy that oneDNN's GEMM reads (one copy of every weight in memory). No torch headers.
//
// The layouts oneDNN picks for fp32 and bf16 weights on AVX-512 and AVX2 CPUs are, for an
// [n, k] weight W, blocks of B output features, outermost; inside a block, the inputs in groups of
// P (1 for fp32; 2 for bf16, the VNNI pairs), each group holding its B outputs' P inputs:
//
//   offset(o, i) = (o / B) * (k_padded * B) + (i / P) * (B * P) + (o % B) * P + i % P
//
// with n padded to a multiple of B and k to k_padded. Which B and padding oneDNN chose is read
// from the packed buffer's size; linear_prepack checks every element against the plain weight
// before it trusts a layout, and keeps the plain weight when none matches (other CPUs, shapes).

#include <cstdint>
#include <optional>

namespace kvserve::ops {

struct PackedLayout {
  int64_t block_out = 0;  ///< B
  int64_t pair = 1;       ///< P
  int64_t k_padded = 0;

  int64_t offset(int64_t o, int64_t i) const {
    return (o / block_out) * (k_padded * block_out) + (i / pair) * (block_out * pair) +
           (o % block_out) * pair + i % pair;
  }
};

/// The layout of a packed [n, k] weight holding `numel` elements (padding included), with P =
/// `pair`: the first B of {64, 48, 32, 16} and the smallest k padding (to a multiple of 1, 2, 4,
/// ..., 64) whose padded size is `numel`. nullopt when none is.
inline std::optional<PackedLayout> packed_layout(int64_t n, int64_t k, int64_t pair,
                                                 int64_t numel) {
  auto round_up = [](int64_t x, int64_t m) { return (x + m - 1) / m * m; };
  for (int64_t block : {64, 48, 32, 16}) {
    for (int64_t multiple = 1; multiple <= 64; multiple *= 2) {
      const int64_t k_padded = round_up(round_up(k, pair), multiple);
      if (round_up(n, block) * k_padded == numel) return PackedLayout{block, pair, k_padded};
    }
  }
  return std::nullopt;
}

}  // namespace kvserve::ops
