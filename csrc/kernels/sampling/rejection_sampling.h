#pragma once
// Speculative verification by modified rejection sampling (Leviathan et al. 2023, Chen et al.
// 2023): the tokens it emits are distributed exactly as the target's own samples, whatever the
// drafts were. Randomness comes in as one uniform number per target row, so a sequence's result
// depends only on its own rows and numbers.

#include <ATen/core/Tensor.h>

#include <tuple>

namespace kvserve::ops {

/// For B sequences, sequence b with k_b >= 0 draft tokens (N = sum of k_b):
///   target_probs fp32 [N + B, vocab]: k_b + 1 rows per sequence from row cu_num_drafts[b] + b,
///     the target's distribution at each draft position and then at the bonus position. A row
///     that is all zero (or not finite) has no distribution.
///   draft_probs fp32 [N, vocab], the distribution each draft was drawn from; or 0 rows, when
///     every draft is a point mass (q(x) = 1, prompt lookup).
///   draft_token_ids int64 [N]; cu_num_drafts int64 [B + 1], from 0, non-decreasing.
///   uniform fp32 [N + B] in [0, 1), aligned with target_probs' rows.
/// Draft j of b is accepted when uniform * q(x) < p(x), i.e. with probability min(1, p/q). At the
/// first rejection the sequence ends with a draw from the normalised residual max(p - q, 0), made
/// with the uniform of its bonus row; when all k_b are accepted, with a draw from the bonus row.
/// Draws are by inverse CDF (the first token whose cumulative probability exceeds u * total).
/// Returns (tokens int64 [B, max k_b + 1], num_accepted int64 [B]): row b holds the accepted
/// drafts, then the drawn token, then -1. The drawn token is -1 when the row it comes from has no
/// distribution (a draft position without one counts as the rejection point).
std::tuple<at::Tensor, at::Tensor> rejection_sample(const at::Tensor& target_probs,
                                                    const at::Tensor& draft_probs,
                                                    const at::Tensor& draft_token_ids,
                                                    const at::Tensor& cu_num_drafts,
                                                    const at::Tensor& uniform);

}  // namespace kvserve::ops
