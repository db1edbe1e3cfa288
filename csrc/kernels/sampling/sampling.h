#pragma once
// Token sampling from logits: temperature, top-k, top-p, min-p, greedy. Randomness comes in as
// one uniform number per row, so results depend only on the row and its own random stream.

#include <ATen/core/Tensor.h>

namespace kvserve::ops {

/// In place, per row of logits (fp32 [num_rows, vocab], last dim contiguous): divide by
/// temperature, then set to -inf what top-k (k <= 0: off), then top-p (1: off), then min-p
/// (0: off) remove. Rows with temperature 0 (greedy) are left untouched. top-k keeps the logits
/// >= the k-th largest; top-p keeps x when the softmax mass (fp64) of the logits top-k kept that
/// are <= x exceeds 1 - p, and always the maximum; min-p keeps x >= max + log(min_p). So tied
/// logits share one fate, on every device.
/// temperature, top_p, min_p: fp32 [num_rows]; top_k: int64 [num_rows].
void sampling_filter_logits(at::Tensor& logits, const at::Tensor& temperature,
                            const at::Tensor& top_k, const at::Tensor& top_p,
                            const at::Tensor& min_p);

/// Returns int64 [num_rows]: argmax for rows with temperature 0, otherwise the first token whose
/// cumulative softmax probability exceeds uniform[r] (fp32 in [0, 1)). Logits as filtered above.
/// A row that is no distribution (a NaN or +inf logit, or every logit -inf) gives -1; the filter
/// leaves such rows unchanged after the temperature.
at::Tensor sampling_from_logits(const at::Tensor& logits, const at::Tensor& temperature,
                                const at::Tensor& uniform);

}  // namespace kvserve::ops
