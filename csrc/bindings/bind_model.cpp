// Python bindings of ModelConfig, the forward batch and the models (CausalLM).
#include <torch/csrc/utils/pybind.h>
#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "kvserve/forward_batch.h"
#include "kvserve/kv_cache.h"
#include "kvserve/paged_kv_cache.h"
#include "models/model_factory.h"

namespace py = pybind11;

namespace kvserve::bindings {
namespace {

void bind_config(py::module_& m) {
  py::class_<RopeScaling>(m, "RopeScaling")
      .def(py::init<>())
      .def_readwrite("rope_type", &RopeScaling::rope_type)
      .def_readwrite("factor", &RopeScaling::factor)
      .def_readwrite("low_freq_factor", &RopeScaling::low_freq_factor)
      .def_readwrite("high_freq_factor", &RopeScaling::high_freq_factor)
      .def_readwrite("original_max_position_embeddings",
                     &RopeScaling::original_max_position_embeddings)
      .def_readwrite("beta_fast", &RopeScaling::beta_fast)
      .def_readwrite("beta_slow", &RopeScaling::beta_slow)
      .def_readwrite("attention_factor", &RopeScaling::attention_factor)
      .def_readwrite("mscale", &RopeScaling::mscale)
      .def_readwrite("mscale_all_dim", &RopeScaling::mscale_all_dim)
      .def_readwrite("truncate", &RopeScaling::truncate);

  py::class_<MLAConfig>(m, "MLAConfig")
      .def(py::init<>())
      .def_readwrite("q_lora_rank", &MLAConfig::q_lora_rank)
      .def_readwrite("kv_lora_rank", &MLAConfig::kv_lora_rank)
      .def_readwrite("qk_nope_head_dim", &MLAConfig::qk_nope_head_dim)
      .def_readwrite("qk_rope_head_dim", &MLAConfig::qk_rope_head_dim)
      .def_readwrite("v_head_dim", &MLAConfig::v_head_dim)
      .def_readwrite("rope_interleave", &MLAConfig::rope_interleave)
      .def_readwrite("attention_path", &MLAConfig::attention_path)
      .def_property_readonly("qk_head_dim", &MLAConfig::qk_head_dim);

  py::class_<MoEConfig>(m, "MoEConfig")
      .def(py::init<>())
      .def_readwrite("num_experts", &MoEConfig::num_experts)
      .def_readwrite("num_experts_per_tok", &MoEConfig::num_experts_per_tok)
      .def_readwrite("moe_intermediate_size", &MoEConfig::moe_intermediate_size)
      .def_readwrite("shared_intermediate_size", &MoEConfig::shared_intermediate_size)
      .def_readwrite("scoring_func", &MoEConfig::scoring_func)
      .def_readwrite("n_group", &MoEConfig::n_group)
      .def_readwrite("topk_group", &MoEConfig::topk_group)
      .def_readwrite("norm_topk_prob", &MoEConfig::norm_topk_prob)
      .def_readwrite("routed_scaling_factor", &MoEConfig::routed_scaling_factor)
      .def_readwrite("fp32_router", &MoEConfig::fp32_router)
      .def_readwrite("layers", &MoEConfig::layers);

  py::class_<ModelConfig>(m, "ModelConfig")
      .def(py::init<>())
      .def_readwrite("architecture", &ModelConfig::architecture)
      .def_readwrite("vocab_size", &ModelConfig::vocab_size)
      .def_readwrite("hidden_size", &ModelConfig::hidden_size)
      .def_readwrite("intermediate_size", &ModelConfig::intermediate_size)
      .def_readwrite("num_layers", &ModelConfig::num_layers)
      .def_readwrite("num_heads", &ModelConfig::num_heads)
      .def_readwrite("num_kv_heads", &ModelConfig::num_kv_heads)
      .def_readwrite("head_dim", &ModelConfig::head_dim)
      .def_readwrite("max_position_embeddings", &ModelConfig::max_position_embeddings)
      .def_readwrite("rms_norm_eps", &ModelConfig::rms_norm_eps)
      .def_readwrite("rope_theta", &ModelConfig::rope_theta)
      .def_readwrite("rope_scaling", &ModelConfig::rope_scaling)
      .def_readwrite("tie_word_embeddings", &ModelConfig::tie_word_embeddings)
      .def_readwrite("qkv_bias", &ModelConfig::qkv_bias)
      .def_readwrite("o_proj_bias", &ModelConfig::o_proj_bias)
      .def_readwrite("mlp_bias", &ModelConfig::mlp_bias)
      .def_readwrite("qk_norm", &ModelConfig::qk_norm)
      .def_readwrite("sliding_windows", &ModelConfig::sliding_windows)
      .def_readwrite("kv_sources", &ModelConfig::kv_sources)
      .def("kv_source", &ModelConfig::kv_source, py::arg("layer"))
      .def("num_kv_layers", &ModelConfig::num_kv_layers)
      .def_readwrite("rope_local_theta", &ModelConfig::rope_local_theta)
      .def_readwrite("hidden_act", &ModelConfig::hidden_act)
      .def_readwrite("norm_weight_offset", &ModelConfig::norm_weight_offset)
      .def_readwrite("embedding_multiplier", &ModelConfig::embedding_multiplier)
      .def_readwrite("sandwich_norms", &ModelConfig::sandwich_norms)
      .def_readwrite("query_pre_attn_scalar", &ModelConfig::query_pre_attn_scalar)
      .def_readwrite("attn_logit_softcap", &ModelConfig::attn_logit_softcap)
      .def_readwrite("final_logit_softcap", &ModelConfig::final_logit_softcap)
      .def_readwrite("mla", &ModelConfig::mla)
      .def_readwrite("moe", &ModelConfig::moe)
      .def("use_mla", &ModelConfig::use_mla)
      .def("is_moe_layer", &ModelConfig::is_moe_layer, py::arg("layer"))
      .def("validate", &ModelConfig::validate);
}

void bind_forward_batch(py::module_& m) {
  py::class_<ForwardBatch>(m, "ForwardBatch", "The flattened tensors of one forward pass.")
      .def_readonly("input_ids", &ForwardBatch::input_ids)
      .def_readonly("positions", &ForwardBatch::positions)
      .def_readonly("metadata", &ForwardBatch::metadata)
      .def_readonly("logits_indices", &ForwardBatch::logits_indices);
  py::class_<ForwardBatchBuilder>(m, "ForwardBatchBuilder")
      .def(py::init<int64_t, bool>(), py::arg("block_size"), py::arg("lora") = false)
      .def("add", &ForwardBatchBuilder::add, py::arg("tokens"), py::arg("num_cached"),
           py::arg("block_table"), py::arg("lora_slot") = -1,
           "Appends a sequence's new tokens; its first num_cached tokens are already cached.")
      .def(
          "build",
          [](const ForwardBatchBuilder& builder, at::Device device, int64_t table_width) {
            return builder.build(device, table_width);
          },
          py::arg("device") = at::Device("cpu"), py::arg("table_width") = 0)
      .def_property_readonly("num_sequences", &ForwardBatchBuilder::num_sequences);
}

void bind_causal_lm(py::module_& m) {
  py::class_<AttentionMetadata>(m, "AttentionMetadata")
      .def(py::init<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(), py::arg("slot_mapping"),
           py::arg("query_start_loc"), py::arg("seq_lens"), py::arg("block_tables"))
      .def_readwrite("slot_mapping", &AttentionMetadata::slot_mapping)
      .def_readwrite("query_start_loc", &AttentionMetadata::query_start_loc)
      .def_readwrite("seq_lens", &AttentionMetadata::seq_lens)
      .def_readwrite("block_tables", &AttentionMetadata::block_tables)
      .def_readwrite("host_query_start_loc", &AttentionMetadata::host_query_start_loc)
      .def_readwrite("host_seq_lens", &AttentionMetadata::host_seq_lens)
      .def_readwrite("host_block_tables", &AttentionMetadata::host_block_tables)
      .def_readwrite("lora_slots", &AttentionMetadata::lora_slots);

  py::class_<CausalLM, std::shared_ptr<CausalLM>>(m, "CausalLM", "A loaded decoder-only model.")
      .def(
          "forward",
          [](CausalLM& model, const at::Tensor& input_ids, const at::Tensor& positions,
             const AttentionMetadata& metadata,
             const std::vector<std::shared_ptr<KVCache>>& caches) {
            std::vector<LayerKVCache> views;
            for (const auto& cache : caches) views.push_back(cache->layer_view());
            return model.forward(input_ids, positions, metadata, views);
          },
          py::arg("input_ids"), py::arg("positions"), py::arg("metadata"), py::arg("kv_caches"),
          py::call_guard<py::gil_scoped_release>(),
          "Hidden states [T, hidden] of a flattened batch; writes K/V at metadata.slot_mapping.")
      .def(
          "forward",
          [](CausalLM& model, const at::Tensor& input_ids, const at::Tensor& positions,
             const AttentionMetadata& metadata, const PagedKVCache& cache) {
            return model.forward(input_ids, positions, metadata, cache.layers());
          },
          py::arg("input_ids"), py::arg("positions"), py::arg("metadata"), py::arg("kv_cache"),
          py::call_guard<py::gil_scoped_release>(),
          "The same over a PagedKVCache (slots and block tables index its blocks).")
      .def("compute_logits", &CausalLM::compute_logits, py::arg("hidden"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "__call__",
          [](CausalLM& model, const at::Tensor& input_ids,
             const std::vector<std::shared_ptr<KVCache>>& kv_caches) {
            std::vector<KVCache*> caches;
            for (const auto& cache : kv_caches) caches.push_back(cache.get());
            return forward_with_kv_cache(model, input_ids, caches);
          },
          py::arg("input_ids"), py::arg("kv_caches"), py::call_guard<py::gil_scoped_release>(),
          "The simple loop (kvserve.compat): input_ids [B, S] appended to the caches; returns logits [B, S, V].")
      .def_property_readonly("config", &CausalLM::config, py::return_value_policy::reference_internal)
      .def_property_readonly("dtype", &CausalLM::dtype)
      .def_property_readonly("device", &CausalLM::device)
      .def_property_readonly("weight_bytes", &CausalLM::weight_bytes)
      .def(
          "lora_targets",
          [](CausalLM& model) {
            std::vector<std::tuple<std::string, int64_t, int64_t, int64_t>> out;
            for (const LoraTarget& t : model.lora_targets()) {
              out.emplace_back(t.name, t.in_features, t.out_features, t.rank);
            }
            return out;
          },
          "(name, in_features, out_features, rank) of every projection that can serve LoRA "
          "adapters (rank 0 until enable_lora).")
      .def("enable_lora", &CausalLM::enable_lora, py::arg("slots"), py::arg("rank"),
           "Room for `slots` adapters of rank up to `rank` in every LoRA target (before serving).")
      .def_property_readonly("num_lora_slots", &CausalLM::num_lora_slots);

  m.def("supported_architectures", &supported_architectures);
  m.def("create_causal_lm", &create_causal_lm, py::arg("config"), py::arg("weights"),
        py::arg("max_positions"));
}

}  // namespace

void bind_model(py::module_& m) {
  bind_config(m);
  bind_forward_batch(m);
  bind_causal_lm(m);
}

}  // namespace kvserve::bindings
