#pragma once
// The low-rank update of LoRA adapters served without merging: each token adds the update of its
// own adapter (or none) to a projection's output, the adapters' A and B stacked by slot (a batched
// gather of A and B by token, as punica's BGMV and S-LoRA do).

#include <ATen/core/Tensor.h>

namespace kvserve::ops {

/// out[t] += scales[s] * B_s (A_s x[t]) for every token t whose slot s = slots[t] >= 0; tokens of
/// slot -1 are left alone. fp32 accumulation, one rounding of out[t] + update to its dtype.
/// x: [T, in_features], rows strided; out: [T, out_features], rows strided; one dtype (fp32,
/// bf16, fp16). lora_a: [num_slots, rank, in_features] contiguous (A_s, row r = A_s[r, :]);
/// lora_b: [num_slots, rank, out_features] contiguous (B_s transposed: row r = B_s[:, r]); both of
/// out's dtype. slots: int32 [T] contiguous, each in [-1, num_slots) (the CPU op checks the
/// values; on CUDA a slot outside that range adds nothing). scales: fp32 [num_slots] contiguous
/// (lora_alpha / rank, or / sqrt(rank) for rsLoRA). Everything on one device.
void lora_add(at::Tensor& out, const at::Tensor& x, const at::Tensor& lora_a,
              const at::Tensor& lora_b, const at::Tensor& slots, const at::Tensor& scales);

}  // namespace kvserve::ops
