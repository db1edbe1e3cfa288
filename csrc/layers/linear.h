#pragma once
// Linear layer y = x W^T + b over flattened tokens, on a plain or a weight-only quantized weight.

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "kvserve/communicator.h"
#include "layers/weights.h"

namespace kvserve {

/// How a Linear holds its weight, and so which op multiplies by it.
enum class QuantScheme {
  kNone,     ///< a plain (or oneDNN-packed) weight: ops::linear
  kInt8,     ///< int8 with scales per row or group (int8, w8a8): ops::quantized_linear
  kInt4,     ///< two int4 per byte, scales and zeros per group (int4, AWQ): the same op
  kFp8,      ///< float8_e4m3fn with fp32 scales per row or group: the same op
  kLlmInt8,  ///< int8 with one scale per row, outlier columns in float (LLM.int8()):
             ///< ops::llm_int8_linear
};

/// "none", "int8", "int4", "fp8" or "llm.int8" (QuantizationConfig::scheme's names).
const char* quant_scheme_name(QuantScheme scheme);
/// QuantizationConfig::scheme of a checkpoint whose projections differ (a GGUF file's block
/// types): each quantized weight runs the scheme whose storage dtype its qweight has.
inline constexpr const char* kMixedScheme = "mixed";
/// The scheme of a QuantizationConfig::scheme name (kNone for "mixed": per weight); throws
/// std::invalid_argument listing them.
QuantScheme quant_scheme_from_name(const std::string& name);

/// A quantized weight as its op reads it: q (int8, packed int4 or fp8 E4M3), scales and zeros
/// (fp32, or both fp16 as the checkpoint stored them) per output row and group of group_size
/// inputs, or two-level (int8 scales and zeros under super_scales and super_mins per
/// super-block: GGUF's K-quants; quantized_linear.h); for kLlmInt8 one fp32 scale per row and
/// the outlier threshold.
struct QuantizedLinearWeight {
  QuantScheme scheme = QuantScheme::kNone;
  at::Tensor qweight, scales, zeros;  // zeros may be undefined, or [1] (Linear: one for all)
  at::Tensor super_scales, super_mins;  // undefined but for two-level scales
  int64_t group_size = 0;
  double outlier_threshold = -1.0;  // kLlmInt8 only
  bool quantize_input = false;      // kInt8 / kInt4: QuantizationConfig::activation "int8"

  /// `<name>.qweight`, `<name>.scales`, optional `<name>.zeros` (and, for two-level scales,
  /// `<name>.super_scales` and `<name>.super_mins`) of a weight map (the group size
  /// is in_features over the scales' columns), in the scheme the map's QuantizationConfig names;
  /// weight_only (routed experts): kLlmInt8 runs as kInt8. Throws std::invalid_argument on a
  /// missing tensor, a map that names no scheme, or a qweight dtype other than the scheme's;
  /// c10::Error on a bad shape.
  static QuantizedLinearWeight load(const WeightMap& weights, const std::string& name,
                                    bool weight_only = false);
  /// Bytes of qweight, scales, zeros and super-block factors.
  int64_t nbytes() const;
};

class Linear;

/// A projection that can serve LoRA adapters, as a layer lists it: its name under the layer's
/// prefix, the Linear, and how many of the checkpoint's projections it fuses (qkv: 3, gate_up:
/// 2), each of which an adapter may target with its own rank.
struct LoraLinear {
  std::string name;
  Linear* linear;
  int64_t parts = 1;
};

/// A projection on a plain weight (ops::linear) or a quantized one (ops::quantized_linear): the
/// model code does not know which.
class Linear {
 public:
  Linear() = default;
  /// The projection `name` of a weight map: `<name>.weight` (plain), or `<name>.qweight`,
  /// `<name>.scales` and optional `<name>.zeros` (quantized; the group size is in_features over
  /// the scales' columns; the scheme is the map's QuantizationConfig's), or quantized parts
  /// `<name>.parts.<i>.qweight`, ... from i = 0 (a fused projection whose parts' layouts
  /// differ); `<name>.bias` optional. Throws std::invalid_argument when none is there.
  static Linear load(const WeightMap& weights, const std::string& name);
  /// The same for a row-parallel projection (o_proj, down_proj): when the map's weights are
  /// split over several ranks, each holds the columns of its share of the inputs (and rank 0
  /// the bias), and forward sums the ranks' partial outputs (Communicator::all_reduce_).
  static Linear load_row_parallel(const WeightMap& weights, const std::string& name);

  /// weight [out_features, in_features]; bias [out_features] or undefined. One copy of the weight
  /// is kept: packed by ops::linear_prepack where the device's GEMM has a packed layout that
  /// kvserve's GEMV reads too (fp32 / bf16 on CPU), else the plain weight.
  Linear(at::Tensor weight, at::Tensor bias);
  /// A quantized weight [out_features, in_features] and bias [out_features] or undefined.
  Linear(QuantizedLinearWeight weight, at::Tensor bias);
  /// Quantized projections of one input stacked along the output (a GGUF file's q and k in
  /// Q4_K beside v in Q6_K): each multiplied in its own layout, the outputs concatenated, rather
  /// than all widened to the widest (which read a Q4_K_M file's q/k/v at twice the bytes);
  /// bias [the parts' out_features summed] or undefined.
  Linear(std::vector<Linear> parts, at::Tensor bias);

  /// x [T, in_features] -> [T, out_features], in the weight dtype (summed over the ranks for a
  /// row-parallel projection).
  at::Tensor forward(const at::Tensor& x) const;
  /// The same, plus each token's LoRA update (ops::lora_add) when LoRA is enabled and
  /// lora_slots (int32 [T], -1: none) is defined.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& lora_slots) const;

  /// Room for `slots` LoRA adapters of rank up to `rank` (zero: no update), in `dtype` (the
  /// activations') on `device`.
  void enable_lora(int64_t slots, int64_t rank, at::ScalarType dtype, at::Device device);
  /// Slot `slot`'s factors, scaling included: a [r, in_features] and b [r, out_features] (B
  /// transposed), r <= the rank; the update is x a^T b. Throws c10::Error on a bad shape.
  void set_lora(int64_t slot, const at::Tensor& a, const at::Tensor& b);
  /// The checks of set_lora, writing nothing (a model validates every projection's factors
  /// before it writes any).
  void check_lora(int64_t slot, const at::Tensor& a, const at::Tensor& b) const;
  /// Slot `slot` adds nothing.
  void clear_lora(int64_t slot);
  bool lora_enabled() const { return lora_a_.defined(); }

  /// Rows `ids` (int64 [T]) of the weight, [T, in_features]: an embedding's lookup (tied to the
  /// head, or quantized). A plain weight's rows as they are (in its dtype); a quantized one's
  /// dequantized, (q - zero) * scale per group in fp32, then rounded to `dtype`.
  at::Tensor rows(const at::Tensor& ids, at::ScalarType dtype) const;

  int64_t in_features() const { return in_features_; }
  int64_t out_features() const { return out_features_; }
  bool packed() const { return weight_.defined() && weight_.is_mkldnn(); }
  /// The scheme of a weight held whole (kNone for a plain one and for parts).
  QuantScheme scheme() const { return quantized_.scheme; }
  bool quantized() const { return quantized_.scheme != QuantScheme::kNone || !parts_.empty(); }
  bool defined() const { return weight_.defined() || quantized(); }
  /// Bytes of the weight as held (a packed one pads its blocks) and the bias; 0 when undefined.
  int64_t weight_bytes() const;
  /// Whether forward sums partial outputs over several ranks.
  bool row_parallel() const { return reduce_ != nullptr; }

 private:
  at::Tensor local_forward(const at::Tensor& x) const;

  at::Tensor weight_;  // plain [out, in], or packed by ops::linear_prepack; or undefined
  QuantizedLinearWeight quantized_;  // or this
  std::vector<Linear> parts_;        // or these, each with its rows of the bias
  at::Tensor bias_;
  int64_t in_features_ = 0, out_features_ = 0;
  // LoRA factors by slot (ops::lora_add): [slots, rank, in], [slots, rank, out], fp32 [slots]
  // of ones (the scaling is in b); undefined until enable_lora.
  at::Tensor lora_a_, lora_b_, lora_scales_;
  std::shared_ptr<Communicator> reduce_;  // row-parallel over these ranks; null otherwise
};

}  // namespace kvserve
