#include "layers/linear.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/bitwise_and.h>
#include <ATen/ops/bitwise_right_shift.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>

#include <stdexcept>
#include <string>

#include "kernels/linear/linear.h"
#include "kernels/linear/llm_int8_linear.h"
#include "kernels/linear/lora_add.h"
#include "kernels/linear/quantized_linear.h"
#include "layers/weights.h"

namespace kvserve {

const at::Tensor& WeightMap::get(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) throw std::invalid_argument("missing weight: " + name);
  return it->second;
}

at::Tensor WeightMap::get_optional(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? at::Tensor() : it->second;
}

Linear Linear::load(const WeightMap& w, const std::string& name) {
  at::Tensor bias = w.get_optional(name + ".bias");
  const auto part = [&](size_t i) { return name + ".parts." + std::to_string(i); };
  if (w.get_optional(part(0) + ".qweight").defined()) {
    std::vector<Linear> parts;
    while (w.get_optional(part(parts.size()) + ".qweight").defined()) {
      parts.emplace_back(QuantizedLinearWeight::load(w, part(parts.size())), at::Tensor());
    }
    return Linear(std::move(parts), std::move(bias));
  }
  at::Tensor plain = w.get_optional(name + ".weight");
  if (plain.defined() || !w.get_optional(name + ".qweight").defined()) {
    return Linear(w.get(name + ".weight"), std::move(bias));
  }
  return Linear(QuantizedLinearWeight::load(w, name), std::move(bias));
}

namespace {

constexpr QuantScheme kSchemes[] = {QuantScheme::kNone, QuantScheme::kInt8, QuantScheme::kInt4,
                                    QuantScheme::kFp8, QuantScheme::kLlmInt8};

// The qweight dtype a scheme stores.
at::ScalarType storage_dtype(QuantScheme scheme) {
  switch (scheme) {
    case QuantScheme::kInt4: return at::kByte;  // two per byte
    case QuantScheme::kFp8: return at::kFloat8_e4m3fn;
    default: return at::kChar;
  }
}

}  // namespace

const char* quant_scheme_name(QuantScheme scheme) {
  switch (scheme) {
    case QuantScheme::kNone: return "none";
    case QuantScheme::kInt8: return "int8";
    case QuantScheme::kInt4: return "int4";
    case QuantScheme::kFp8: return "fp8";
    case QuantScheme::kLlmInt8: return "llm.int8";
  }
  return "?";
}

QuantScheme quant_scheme_from_name(const std::string& name) {
  if (name == kMixedScheme) return QuantScheme::kNone;  // each weight's own (by its dtype)
  std::string names;
  for (QuantScheme scheme : kSchemes) {
    if (name == quant_scheme_name(scheme)) return scheme;
    names += std::string(names.empty() ? "" : ", ") + quant_scheme_name(scheme);
  }
  throw std::invalid_argument("unknown quantization scheme '" + name + "' (kvserve runs " +
                              names + ", " + kMixedScheme + ")");
}

QuantizedLinearWeight QuantizedLinearWeight::load(const WeightMap& w, const std::string& name,
                                                  bool weight_only) {
  QuantizedLinearWeight q;
  const std::string& scheme = w.quantization().scheme;
  q.scheme = quant_scheme_from_name(scheme);
  if (scheme == kMixedScheme) {  // the scheme whose storage dtype the weight has
    const at::ScalarType dtype = w.get(name + ".qweight").scalar_type();
    for (QuantScheme s : {QuantScheme::kInt8, QuantScheme::kInt4, QuantScheme::kFp8}) {
      if (storage_dtype(s) == dtype) q.scheme = s;
    }
  }
  if (q.scheme == QuantScheme::kNone) {
    throw std::invalid_argument("Linear: " + name + " is quantized (" + name + ".qweight), but "
                                "the model's quantization config names no scheme");
  }
  if (weight_only && q.scheme == QuantScheme::kLlmInt8) q.scheme = QuantScheme::kInt8;
  q.qweight = w.get(name + ".qweight");
  q.scales = w.get(name + ".scales");
  q.zeros = w.get_optional(name + ".zeros");
  q.super_scales = w.get_optional(name + ".super_scales");
  q.super_mins = w.get_optional(name + ".super_mins");
  // Scales and zeros are read as they are where the kernels take them (fp32, or both fp16 as
  // AWQ, GPTQ and GGUF store them; two-level ones as int8 under fp32 or fp16 factors); anything
  // else is widened to fp32 (exact).
  const bool half = q.scales.scalar_type() == at::kHalf &&
                    (!q.zeros.defined() || q.zeros.scalar_type() == at::kHalf);
  if (q.super_scales.defined()) {
    TORCH_CHECK(q.scheme == QuantScheme::kInt8 || q.scheme == QuantScheme::kInt4, "Linear: ",
                name, " has two-level scales, which int8 and int4 weights take, not ",
                quant_scheme_name(q.scheme));
    const bool half_super = q.super_scales.scalar_type() == at::kHalf &&
                            (!q.super_mins.defined() || q.super_mins.scalar_type() == at::kHalf);
    if (!half_super) {
      q.super_scales = q.super_scales.to(at::kFloat);
      if (q.super_mins.defined()) q.super_mins = q.super_mins.to(at::kFloat);
    }
  } else if (!half) {
    q.scales = q.scales.to(at::kFloat);
    if (q.zeros.defined()) q.zeros = q.zeros.to(at::kFloat);
  }
  if (q.qweight.scalar_type() != storage_dtype(q.scheme)) {
    throw std::invalid_argument(
        "Linear: " + name + ".qweight is " + std::string(c10::toString(q.qweight.scalar_type())) +
        "; the " + quant_scheme_name(q.scheme) + " scheme stores " +
        std::string(c10::toString(storage_dtype(q.scheme))));
  }
  const int64_t in = q.qweight.size(-1) * (q.scheme == QuantScheme::kInt4 ? 2 : 1);
  TORCH_CHECK(q.scales.dim() == 2 && q.scales.size(1) > 0 && in % q.scales.size(1) == 0,
              "Linear: ", name, ".scales must be [out, groups] with groups dividing ", in,
              ", got ", q.scales.sizes());
  q.group_size = in / q.scales.size(1);
  if (q.scheme == QuantScheme::kLlmInt8) {
    TORCH_CHECK(q.scales.size(1) == 1 && !q.zeros.defined(), "Linear: ", name,
                " runs LLM.int8(), which needs one scale per row and no zeros");
    q.outlier_threshold = w.quantization().outlier_threshold;
    q.scales = q.scales.view({-1}).to(at::kFloat).contiguous();
  }
  q.quantize_input = (q.scheme == QuantScheme::kInt8 || q.scheme == QuantScheme::kInt4) &&
                     w.quantization().activation == "int8";
  return q;
}

int64_t QuantizedLinearWeight::nbytes() const {
  int64_t bytes = 0;
  for (const at::Tensor* t : {&qweight, &scales, &zeros, &super_scales, &super_mins}) {
    if (t->defined()) bytes += static_cast<int64_t>(t->nbytes());
  }
  return bytes;
}

Linear::Linear(at::Tensor weight, at::Tensor bias)
    : weight_(std::move(weight)), bias_(std::move(bias)) {
  TORCH_CHECK(weight_.dim() == 2, "Linear: weight must be [out, in], got ", weight_.sizes());
  TORCH_CHECK(!bias_.defined() || (bias_.dim() == 1 && bias_.size(0) == weight_.size(0)),
              "Linear: bias must be [", weight_.size(0), "]");
  out_features_ = weight_.size(0);
  in_features_ = weight_.size(1);
  weight_ = weight_.contiguous();
  at::Tensor packed = ops::linear_prepack(weight_);
  if (packed.defined()) weight_ = std::move(packed);  // the plain copy is released
}

Linear::Linear(QuantizedLinearWeight weight, at::Tensor bias)
    : quantized_(std::move(weight)), bias_(std::move(bias)) {
  TORCH_CHECK(quantized_.scheme != QuantScheme::kNone,
              "Linear: a quantized weight needs its scheme (QuantizedLinearWeight::load)");
  const at::Tensor& q = quantized_.qweight;
  TORCH_CHECK(q.dim() == 2, "Linear: qweight must be [out, packed in], got ", q.sizes());
  out_features_ = q.size(0);
  in_features_ = q.size(1) * (quantized_.scheme == QuantScheme::kInt4 ? 2 : 1);
  TORCH_CHECK(!bias_.defined() || (bias_.dim() == 1 && bias_.size(0) == out_features_),
              "Linear: bias must be [", out_features_, "]");
  // Zeros that are one value for every row and group (symmetric formats: llama.cpp's Q4_0 and
  // GPTQ's sym=True store 8 for int4) are kept once, as quantized_linear takes them on the CPU:
  // the kernels then read no zeros from memory.
  at::Tensor& zeros = quantized_.zeros;
  if (zeros.defined() && zeros.numel() > 1 && zeros.device().is_cpu() &&
      !quantized_.super_scales.defined()) {
    const at::Tensor first = zeros.reshape({-1}).narrow(0, 0, 1);
    if (zeros.eq(first.view({1, 1})).all().item<bool>()) zeros = first.clone();
  }
}

Linear::Linear(std::vector<Linear> parts, at::Tensor bias) : parts_(std::move(parts)) {
  TORCH_CHECK(!parts_.empty(), "Linear: parts must not be empty");
  in_features_ = parts_.front().in_features_;
  for (const Linear& part : parts_) {
    TORCH_CHECK(part.quantized_.scheme != QuantScheme::kNone && !part.bias_.defined() &&
                    part.in_features_ == in_features_,
                "Linear: parts must be quantized weights of ", in_features_,
                " inputs without a bias, got one of ", part.in_features_);
    out_features_ += part.out_features_;
  }
  TORCH_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == out_features_),
              "Linear: bias must be [", out_features_, "]");
  if (!bias.defined()) return;
  int64_t start = 0;
  for (Linear& part : parts_) {
    part.bias_ = bias.narrow(0, start, part.out_features_);
    start += part.out_features_;
  }
}

Linear Linear::load_row_parallel(const WeightMap& w, const std::string& name) {
  Linear linear = load(w, name);
  if (w.communicator()->size() > 1) linear.reduce_ = w.communicator();
  return linear;
}

at::Tensor Linear::forward(const at::Tensor& x) const {
  at::Tensor y = local_forward(x);
  if (reduce_) reduce_->all_reduce_(y);
  return y;
}

at::Tensor Linear::local_forward(const at::Tensor& x) const {
  if (!parts_.empty()) {
    std::vector<at::Tensor> outputs;
    outputs.reserve(parts_.size());
    for (const Linear& part : parts_) outputs.push_back(part.local_forward(x));
    return at::cat(outputs, 1);
  }
  const auto bias = bias_.defined() ? std::optional<at::Tensor>(bias_) : std::nullopt;
  const QuantizedLinearWeight& q = quantized_;
  switch (q.scheme) {
    case QuantScheme::kNone: return ops::linear(x, weight_, bias);
    case QuantScheme::kLlmInt8:
      return ops::llm_int8_linear(x, q.qweight, q.scales, q.outlier_threshold, bias);
    case QuantScheme::kInt8:
    case QuantScheme::kInt4:
    case QuantScheme::kFp8: {
      const auto optional = [](const at::Tensor& t) {
        return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
      };
      return ops::quantized_linear(x, q.qweight, q.scales, optional(q.zeros), q.group_size, bias,
                                   q.quantize_input, optional(q.super_scales),
                                   optional(q.super_mins));
    }
  }
  TORCH_CHECK(false, "Linear: unknown quantization scheme");
}

at::Tensor Linear::forward(const at::Tensor& x, const at::Tensor& lora_slots) const {
  at::Tensor y = local_forward(x);
  if (lora_a_.defined() && lora_slots.defined()) {
    ops::lora_add(y, x, lora_a_, lora_b_, lora_slots, lora_scales_);
  }
  if (reduce_) reduce_->all_reduce_(y);  // a row-parallel LoRA's partial update too
  return y;
}

void Linear::enable_lora(int64_t slots, int64_t rank, at::ScalarType dtype, at::Device device) {
  TORCH_CHECK(slots >= 1 && rank >= 1, "Linear: LoRA needs at least one slot and rank 1, got ",
              slots, " slots of rank ", rank);
  const auto options = at::TensorOptions().dtype(dtype).device(device);
  lora_a_ = at::zeros({slots, rank, in_features_}, options);
  lora_b_ = at::zeros({slots, rank, out_features_}, options);
  lora_scales_ = at::ones({slots}, options.dtype(at::kFloat));
}

void Linear::set_lora(int64_t slot, const at::Tensor& a, const at::Tensor& b) {
  check_lora(slot, a, b);
  clear_lora(slot);
  const int64_t r = a.size(0);
  lora_a_[slot].narrow(0, 0, r).copy_(a);
  lora_b_[slot].narrow(0, 0, r).copy_(b);
}

void Linear::check_lora(int64_t slot, const at::Tensor& a, const at::Tensor& b) const {
  TORCH_CHECK(lora_a_.defined(), "Linear: LoRA is not enabled");
  TORCH_CHECK(slot >= 0 && slot < lora_a_.size(0), "Linear: LoRA slot ", slot, " outside [0, ",
              lora_a_.size(0), ")");
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(0) == b.size(0) &&
                  a.size(0) <= lora_a_.size(1) && a.size(1) == in_features_ &&
                  b.size(1) == out_features_,
              "Linear: LoRA factors must be a [r, ", in_features_, "] and b [r, ", out_features_,
              "] with r <= ", lora_a_.size(1), ", got ", a.sizes(), " and ", b.sizes());
  TORCH_CHECK(a.is_floating_point() && b.is_floating_point(),
              "Linear: LoRA factors must be floating point, got ", a.scalar_type(), " and ",
              b.scalar_type());
}

void Linear::clear_lora(int64_t slot) {
  TORCH_CHECK(lora_a_.defined() && slot >= 0 && slot < lora_a_.size(0),
              "Linear: no LoRA slot ", slot);
  lora_a_[slot].zero_();
  lora_b_[slot].zero_();
}

at::Tensor Linear::rows(const at::Tensor& ids, at::ScalarType dtype) const {
  TORCH_CHECK(parts_.empty(), "Linear: rows of a weight held in parts");
  if (!quantized()) return ops::linear_gather_rows(weight_, ids);
  const QuantizedLinearWeight& w = quantized_;
  at::Tensor q = w.qweight.index_select(0, ids);
  const int64_t t = q.size(0);
  if (w.scheme == QuantScheme::kInt4) {  // two per byte in chunks of 32: low nibbles first
    const at::Tensor chunks = q.view({t, -1, 1, 16});
    q = at::cat({at::bitwise_and(chunks, 0x0f), at::bitwise_right_shift(chunks, 4)}, 2);
  }
  at::Tensor values = q.to(at::kFloat).view({t, w.scales.dim() == 1 ? 1 : w.scales.size(1), -1});
  if (w.super_scales.defined()) {  // two-level: q * super_scale * scale - super_min * zero
    const int64_t supers = w.super_scales.size(1);
    const auto per_group = [&](const at::Tensor& ints, const at::Tensor& factors) {
      const at::Tensor f = factors.index_select(0, ids).to(at::kFloat).unsqueeze(2);
      return (ints.index_select(0, ids).to(at::kFloat).view({t, supers, -1}) * f)
          .view({t, -1, 1});
    };
    values = values * per_group(w.scales, w.super_scales);
    if (w.zeros.defined()) values = values - per_group(w.zeros, w.super_mins);
    return values.view({t, in_features_}).to(dtype);
  }
  const at::Tensor scales = w.scales.dim() == 1 ? w.scales.unsqueeze(1) : w.scales;  // LLM.int8()
  if (w.zeros.defined()) {  // one per row and group, or one for all
    values = values - (w.zeros.dim() == 1 ? w.zeros.view({1, 1, 1})
                                          : w.zeros.index_select(0, ids).unsqueeze(2));
  }
  values = values * scales.index_select(0, ids).unsqueeze(2);
  return values.view({t, in_features_}).to(dtype);
}

int64_t Linear::weight_bytes() const {
  const auto bytes = [](const at::Tensor& t) {
    return t.defined() ? static_cast<int64_t>(t.nbytes()) : int64_t{0};
  };
  if (!parts_.empty()) {
    int64_t total = 0;
    for (const Linear& part : parts_) total += part.weight_bytes();
    return total;
  }
  const int64_t weight = quantized()           ? quantized_.nbytes()
                         : weight_.defined() ? ops::linear_weight_nbytes(weight_)
                                             : 0;
  return weight == 0 ? 0 : weight + bytes(bias_);
}

}  // namespace kvserve
