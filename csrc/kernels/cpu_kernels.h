#pragma once
// Signatures of the vectorized CPU kernel bodies (raw pointers, sizes, strides; no tensors).
// Launchers in `*_cpu.cpp` check their tensors and call `stub.get()(...)`; the bodies live in
// `*_cpu_kernel.cpp`, compiled once per CPU capability. Strides count elements, not bytes.

#include <c10/core/ScalarType.h>

#include <cstdint>

#include "kernels/cpu_dispatch.h"

namespace kvserve::cpu {

/// out[r] = input[r] * rsqrt(mean(input[r]^2) + eps) * weight, fp32 accumulation.
/// input/out [rows, hidden] with row strides, of `dtype`; weight [hidden], of `dtype` or fp32.
using RmsNormFn = void (*)(c10::ScalarType dtype, void* out, int64_t out_stride, const void* input,
                           int64_t input_stride, const void* weight, bool fp32_weight,
                           int64_t rows, int64_t hidden, float eps);
KVSERVE_CPU_STUB(rms_norm_stub, RmsNormFn);

/// residual[r] += input[r] (rounded to dtype); input[r] = rms_norm(residual[r]) * weight.
using FusedAddRmsNormFn = void (*)(c10::ScalarType dtype, void* input, int64_t input_stride,
                                   void* residual, int64_t residual_stride, const void* weight,
                                   bool fp32_weight, int64_t rows, int64_t hidden, float eps);
KVSERVE_CPU_STUB(fused_add_rms_norm_stub, FusedAddRmsNormFn);

/// layer_norm's body (contract: kernels/norm/layer_norm.h): weight fp32 [hidden], bias fp32
/// [hidden] or null.
using LayerNormFn = void (*)(c10::ScalarType dtype, void* out, int64_t out_stride,
                             const void* input, int64_t input_stride, const float* weight,
                             const float* bias, int64_t rows, int64_t hidden, float eps);
KVSERVE_CPU_STUB(layer_norm_stub, LayerNormFn);

/// out[t, i] = silu(input[t, i]) * input[t, d + i] for i < d; input [T, 2d], out [T, d].
using SiluAndMulFn = void (*)(c10::ScalarType dtype, void* out, int64_t out_stride, const void* input,
                              int64_t input_stride, int64_t num_tokens, int64_t d);
KVSERVE_CPU_STUB(silu_and_mul_stub, SiluAndMulFn);

/// out[t, i] = gelu_tanh(input[t, i]) * input[t, d + i] for i < d; same layout as silu_and_mul.
KVSERVE_CPU_STUB(gelu_tanh_and_mul_stub, SiluAndMulFn);

/// clamped_swiglu_and_mul's body (contract: kernels/activation/clamped_swiglu_and_mul.h); same
/// layout as silu_and_mul.
using ClampedSwigluAndMulFn = void (*)(c10::ScalarType dtype, void* out, int64_t out_stride,
                                       const void* input, int64_t input_stride,
                                       int64_t num_tokens, int64_t d, float alpha, float limit);
KVSERVE_CPU_STUB(clamped_swiglu_and_mul_stub, ClampedSwigluAndMulFn);

/// One lora_add call (contract: kernels/linear/lora_add.h): out [T, out_features] and x
/// [T, in_features] with row strides, of `dtype`; lora_a [slots, rank, in_features] and lora_b
/// [slots, rank, out_features] contiguous, of `dtype`; slots int32 [T] in [-1, slots); scales
/// fp32 [slots].
struct LoraAddArgs {
  c10::ScalarType dtype;
  void* out;
  int64_t out_stride;
  const void* x;
  int64_t x_stride;
  const void* lora_a;
  const void* lora_b;
  const int32_t* slots;
  const float* scales;
  int64_t num_tokens, in_features, out_features, rank;
};
using LoraAddFn = void (*)(const LoraAddArgs& args);
KVSERVE_CPU_STUB(lora_add_stub, LoraAddFn);

/// Rotates query [T, num_heads, head_dim] and key [T, num_kv_heads, head_dim] in place
/// (rows strided by query_stride/key_stride, heads contiguous) with cos_sin_cache
/// [max_position, rot_dim] (fp32: rot_dim/2 cosines then rot_dim/2 sines) at positions [T].
/// is_neox: rotate halves (x[i], x[i + rot_dim/2]); otherwise adjacent pairs (x[2i], x[2i+1]).
/// query_norm / key_norm: [head_dim] weights (dtype, or fp32 with fp32_norm) of an RMSNorm over
/// each head of that side before it is rotated, or null for none.
using RotaryEmbeddingFn = void (*)(c10::ScalarType dtype, const int64_t* positions, void* query,
                                   int64_t query_stride, int64_t num_heads, void* key,
                                   int64_t key_stride, int64_t num_kv_heads, int64_t head_dim,
                                   const float* cos_sin_cache, int64_t rot_dim, int64_t num_tokens,
                                   bool is_neox, const void* query_norm, const void* key_norm,
                                   bool fp32_norm, float norm_epsilon);
KVSERVE_CPU_STUB(rotary_embedding_stub, RotaryEmbeddingFn);

/// out[t] = sum_j weights[t * k + j] * expert_out[t * k + j] for T tokens of k slots, rows of
/// `hidden` contiguous elements of `dtype`; weights fp32 [T * k]; fp32 accumulation in slot order.
using MoECombineFn = void (*)(c10::ScalarType dtype, const void* expert_out, const float* weights,
                              void* out, int64_t num_tokens, int64_t k, int64_t hidden);
KVSERVE_CPU_STUB(moe_combine_stub, MoECombineFn);

/// One moe_routing call (contract: kernels/moe/moe_routing.h): logits [num_tokens, num_experts]
/// of `dtype` with row stride logits_stride; bias fp32 [num_experts] or null; writes weights fp32
/// and ids int64, both [num_tokens, top_k] contiguous.
struct MoERoutingArgs {
  c10::ScalarType dtype;
  const void* logits;
  int64_t logits_stride;
  const float* bias;
  int64_t num_tokens, num_experts, top_k;
  bool sigmoid;  // sigmoid scores (groups rank by their best two); else softmax (by their best)
  int64_t n_group, topk_group;
  bool renormalize;
  float routed_scaling_factor;
  float* weights;
  int64_t* ids;
};
using MoERoutingFn = void (*)(const MoERoutingArgs& args);
KVSERVE_CPU_STUB(moe_routing_stub, MoERoutingFn);

/// How a KV cache stores its entries: in the query's dtype, or quantized with one fp32 scale per
/// (token, KV head) row (contract: kernels/cache/kv_cache_write.h).
enum class KVCacheFormat : int { kPlain = 0, kInt8 = 1, kFp8E4M3 = 2 };

/// Geometry of one paged_attention call; see kernels/attention/paged_attention.h for the contract.
struct PagedAttentionArgs {
  c10::ScalarType dtype;           // of query and out (and of the caches when kPlain)
  KVCacheFormat cache_format;
  void* out;                       // [T, num_heads, value_head_dim], row stride out_stride
  const void* query;               // [T, num_heads, head_dim], row stride query_stride
  const void* key_cache;           // [num_blocks, block_size, num_kv_heads, head_dim]
  const void* value_cache;         // [num_blocks, block_size, num_kv_heads, value_row]; a value
                                   // is the first value_head_dim elements of its row
  const float* key_scale;          // quantized caches: [num_blocks, block_size, num_kv_heads],
  const float* value_scale;        // a row's entries times its scale are its values; else null
  const int32_t* query_start_loc;  // [num_seqs + 1]
  const int32_t* seq_lens;         // [num_seqs], context length including the new queries
  const int32_t* block_tables;     // [num_seqs, max_blocks_per_seq]
  int64_t out_stride, query_stride;
  int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks_per_seq;
  int64_t value_head_dim, value_row;
  int64_t cache_block_stride;        // elements between blocks of the key cache
  int64_t value_cache_block_stride;  // elements between blocks of the value cache
  bool value_in_key;               // value_cache is key_cache (MLA latents): a value is the
                                   // first value_head_dim elements of its key
  float scale;
  int64_t sliding_window;          // <= 0: no window
  float logit_softcap;             // <= 0: no soft-cap
  const float* sinks;              // [num_heads]: a logit per head in each softmax; null: none
};
using PagedAttentionFn = void (*)(const PagedAttentionArgs& args);
KVSERVE_CPU_STUB(paged_attention_stub, PagedAttentionFn);

/// out [m, n] = input [m, k] (row stride input_stride) @ weight^T ([n, k] contiguous) + bias [n]
/// (nullable); all of `dtype`, fp32 accumulation. For small m: the weight is streamed once per
/// block of tokens.
using GemvFn = void (*)(c10::ScalarType dtype, const void* input, int64_t input_stride,
                        const void* weight, const void* bias, void* out, int64_t m, int64_t n,
                        int64_t k);
KVSERVE_CPU_STUB(gemv_stub, GemvFn);

/// The same with the weight in oneDNN's packed layout (kernels/linear/linear_packed_layout.h:
/// blocks of block_out outputs, k padded to k_padded, bf16 in pairs); fp32 or bf16 only.
using GemvPackedFn = void (*)(c10::ScalarType dtype, const void* input, int64_t input_stride,
                              const void* weight, const void* bias, void* out, int64_t m,
                              int64_t n, int64_t k, int64_t block_out, int64_t k_padded);
KVSERVE_CPU_STUB(gemv_packed_stub, GemvPackedFn);

/// How a quantized_linear weight stores q (contract: kernels/linear/quantized_linear.h).
enum class QuantFormat : int { kInt8 = 0, kInt4 = 1, kFp8E4M3 = 2 };

/// One quantized weight [n, k]: packed q, scales and zeros (nullable) [n, k / group_size], both
/// fp32 or both fp16 (`half_params`; kernels widen a row's at a time: quantized_row_params);
/// with `shared_zero`, zeros is one value for every row and group. With `super_scales`
/// (two-level scales, llama.cpp's K-quants), scales and zeros are int8 integers per group under
/// fp32 or fp16 (`half_params`) factors per super-block of `super_group` groups,
/// super_scales and super_mins [n, groups / super_group]: a group's scale is
/// super_scale * scale and its zero term (zero * scale in the one-level form) super_min * zero.
struct QuantizedWeight {
  QuantFormat format;
  const void* q;
  const void* scales;
  const void* zeros;
  bool half_params;
  int64_t n, k, group_size;
  bool shared_zero = false;
  const void* super_scales = nullptr;
  const void* super_mins = nullptr;
  int64_t super_group = 0;
};

/// LLM.int8()'s integer part (kernels/linear/llm_int8_linear.h): each token's row of x (fp32
/// [m, k], contiguous, its outliers already zeroed) rounded to int8 at s_t = max|x_t| / 127 (round
/// half to even; s_t = 0 for a row of zeros, NaN for a row holding a NaN or an infinity), then
/// out[t, o] = float(sum_j q[t, j] * w[o, j]) * s_t * w_scales[o], the sum in int32, for w int8
/// [n, k] contiguous and w_scales fp32 [n]; out fp32 [m, n], contiguous.
using Int8LinearFn = void (*)(const float* x, int64_t m, int64_t k, const int8_t* w, int64_t n,
                              const float* w_scales, float* out);
KVSERVE_CPU_STUB(int8_linear_stub, Int8LinearFn);

/// out [m, n] = input [m, k] (`dtype`, row stride input_stride) @ dequant(w)^T + bias [n]
/// (nullable, `dtype`), fp32 accumulation, for small m: the weight is streamed once per block of
/// tokens and dequantized in registers.
using QuantizedGemvFn = void (*)(c10::ScalarType dtype, const void* input, int64_t input_stride,
                                 const QuantizedWeight& w, const void* bias, void* out, int64_t m);
KVSERVE_CPU_STUB(quantized_gemv_stub, QuantizedGemvFn);

/// The same product with the input rounded to int8 (quantized_linear.h's quantize_input), for
/// int8 and int4 weights: each token's blocks rounded once, then integer dot products of a block
/// of the weight with each token's block (maddubs on AVX2), scaled per block and group.
KVSERVE_CPU_STUB(quantized_gemv_int8_input_stub, QuantizedGemvFn);

/// The most tokens this capability's quantized_gemv_int8_input takes for w (the launcher rounds
/// more and runs the dequantizing GEMM): 32 for the vector kernels; any number where AMX tiles
/// take w (quantized_linear_int8_input_tiles.h).
using QuantizedInt8InputTokensFn = int64_t (*)(const QuantizedWeight& w);
KVSERVE_CPU_STUB(quantized_int8_input_tokens_stub, QuantizedInt8InputTokensFn);

/// The order in which this capability's kernels unpack a row of w's format: order[j] (j < k) is
/// the input that position j holds. Within each 32-input chunk the vector code takes q in the
/// lane order its shifts give (no shuffles); a dot product does not care, so the prefill path
/// permutes the input's columns by `order` and multiplies it with the rows that
/// quantized_dequantize writes in the same order.
using QuantizedOrderFn = void (*)(const QuantizedWeight& w, int64_t* order);
KVSERVE_CPU_STUB(quantized_order_stub, QuantizedOrderFn);

/// dst [row_end - row_begin, k] fp32 (contiguous) = dequant(w) rows [row_begin, row_end), each
/// row's inputs in quantized_order.
using QuantizedDequantizeFn = void (*)(const QuantizedWeight& w, int64_t row_begin,
                                       int64_t row_end, float* dst);
KVSERVE_CPU_STUB(quantized_dequantize_stub, QuantizedDequantizeFn);

/// Per row of logits [rows, vocab] (fp32, row stride): divides by temperature and sets to -inf
/// what top-k, then top-p, then min-p remove. Rows with temperature 0 are left untouched.
using SamplingFilterFn = void (*)(float* logits, int64_t stride, int64_t rows, int64_t vocab,
                                  const float* temperature, const int64_t* top_k,
                                  const float* top_p, const float* min_p);
KVSERVE_CPU_STUB(sampling_filter_stub, SamplingFilterFn);

/// Per row of filtered logits: argmax when temperature is 0, else the token whose cumulative
/// softmax probability first exceeds uniform[r] (inverse CDF; deterministic given uniform).
using SamplingSampleFn = void (*)(const float* logits, int64_t stride, int64_t rows, int64_t vocab,
                                  const float* temperature, const float* uniform, int64_t* out);
KVSERVE_CPU_STUB(sampling_sample_stub, SamplingSampleFn);

/// Modified rejection sampling over B sequences (see kernels/sampling/rejection_sampling.h):
/// target [N + B, vocab] and draft [N, vocab] (null: point-mass drafts) with row strides;
/// out [B, out_stride] prefilled with -1; num_accepted [B].
using RejectionSampleFn = void (*)(const float* target, int64_t target_stride, const float* draft,
                                   int64_t draft_stride, int64_t vocab, const int64_t* draft_ids,
                                   const int64_t* cu_num_drafts, int64_t batch,
                                   const float* uniform, int64_t* out, int64_t out_stride,
                                   int64_t* num_accepted);
KVSERVE_CPU_STUB(rejection_sample_stub, RejectionSampleFn);

/// rms_norm_gated's body (contract: kernels/norm/rms_norm_gated.h); gate may be null, and
/// weight (fp32) null for the gate alone.
using RmsNormGatedFn = void (*)(c10::ScalarType dtype, void* out, int64_t out_stride,
                                const void* input, int64_t input_stride, const void* gate,
                                int64_t gate_stride, const float* weight, int64_t rows,
                                int64_t dim, int64_t group_size, float eps,
                                bool norm_before_gate);
KVSERVE_CPU_STUB(rms_norm_gated_stub, RmsNormGatedFn);

/// ssm_causal_conv1d's body (contract: kernels/ssm/ssm_causal_conv1d.h); weight [dim, kernel]
/// and bias (may be null) in fp32; conv_state in fp32 when fp32_state, else dtype.
using SsmCausalConv1dFn = void (*)(c10::ScalarType dtype, void* out, int64_t out_stride,
                                   const void* input, int64_t input_stride, const float* weight,
                                   const float* bias, void* conv_state, bool fp32_state,
                                   const int32_t* cu_seqlens, const int32_t* slots,
                                   const bool* has_initial_state, int64_t num_seqs, int64_t dim,
                                   int64_t kernel, bool silu);
KVSERVE_CPU_STUB(ssm_causal_conv1d_stub, SsmCausalConv1dFn);

/// ssm_scan's operands (contract: kernels/ssm/ssm_scan.h): token strides in elements; A, D and
/// dt_bias in fp32 (D and dt_bias may be null); the state in fp32 when fp32_state, else dtype.
struct SsmScanArgs {
  void* out;
  int64_t out_stride;
  const void* x;
  int64_t x_stride;
  const void* dt;
  int64_t dt_stride;
  const void* B;
  int64_t B_stride;
  const void* C;
  int64_t C_stride;
  const float* A;  // [heads], or [heads, state_size] with A_per_state
  const float* D;
  const float* dt_bias;
  void* state;
  bool fp32_state, A_per_state;
  const int32_t* cu_seqlens;
  const int32_t* slots;
  const bool* has_initial_state;
  int64_t num_seqs, heads, head_dim, groups, state_size;
  bool dt_softplus;
  float dt_min, dt_max;
};
using SsmScanFn = void (*)(c10::ScalarType dtype, const SsmScanArgs& args);
KVSERVE_CPU_STUB(ssm_scan_stub, SsmScanFn);

}  // namespace kvserve::cpu
